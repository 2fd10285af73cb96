"""Chat prompts for SmolLM2-135M-Instruct: training prompts for `train-heads` and held-out ones for the
bench and the README, written deterministically from templates x topics (no dataset download here).

    python examples/smollm2/make_prompts.py      # writes train.txt (paragraphs), heldout.jsonl, tune.jsonl

Held-out prompts (the bench's) use topics and templates the training prompts never use; tune.jsonl (what
the build's tree: auto decodes) is a third set, so the tree is not chosen on what the bench measures.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}? Give a short answer.", "Write a short paragraph about {t}.",
    "Give me three tips about {t}.", "Why is {t} important?", "Describe how {t} works, step by step.",
    "What are the pros and cons of {t}?", "Summarize the history of {t} in a few sentences.",
    "Write a Python function related to {t}, with a docstring.", "How would you teach {t} to a child?",
    "List five facts about {t}.", "What are common mistakes people make with {t}?",
    "Write a short poem about {t}.", "Compare {t} with something from everyday life.",
    "What questions should I ask to learn more about {t}?", "Write a short dialogue between two friends about {t}.",
    "Give an example that shows {t}.", "What is a fun fact about {t}?", "Explain {t} to an expert in one paragraph.",
    "Write a short story that involves {t}.",
]
TOPICS = [
    "photosynthesis", "the water cycle", "gravity", "volcanoes", "the solar system", "electricity", "magnets",
    "the human heart", "vaccines", "climate change", "recycling", "healthy sleep", "drinking water", "exercise",
    "learning a new language", "saving money", "cooking pasta", "growing tomatoes", "time management",
    "public speaking", "writing an essay", "reading books", "the internet", "email etiquette", "passwords",
    "sorting algorithms", "binary search", "recursion", "hash tables", "linked lists", "Python lists",
    "Python dictionaries", "unit testing", "version control with git", "regular expressions", "JSON files",
    "databases", "SQL queries", "web browsers", "operating systems", "computer memory", "CPUs", "batteries",
    "solar panels", "wind power", "bicycles", "trains", "airplanes", "bridges", "the Roman Empire",
    "the printing press", "music theory", "painting with watercolors", "chess openings", "football",
    "the Olympic games", "friendship", "kindness", "teamwork", "job interviews", "resumes",
    "coffee", "tea", "dogs", "cats", "birds", "forests", "deserts", "rivers", "mountains", "clouds",
    "photography", "gardening", "the stock market", "inflation", "taxes", "voting", "maps", "clocks",
    "object-oriented programming", "functional programming", "APIs", "cloud computing", "machine learning",
]
HELDOUT_TEMPLATES = ["Can you explain {t} briefly?", "Write a few sentences about {t} for a beginner.",
                     "What should everyone know about {t}?"]
HELDOUT_TOPICS = ["earthquakes", "the moon", "rainbows", "bread baking", "stack data structures", "HTTP requests",
                  "meditation", "libraries", "ocean tides", "compilers"]
# What the build's tree: auto decodes (eagle.prompts): neither training nor held-out topics or templates.
TUNE = ["Tell me about snowflakes.", "How do submarines stay underwater?", "What is a good way to learn chess?",
        "Explain what a queue is in programming.", "Why do leaves change color in autumn?",
        "Describe a healthy breakfast.", "What does a database index do?", "How do bees make honey?"]


def main(out: Path = Path(__file__).parent) -> None:
    rng = random.Random(0)
    train = [tmpl.format(t=t) for t in TOPICS for tmpl in TEMPLATES]
    rng.shuffle(train)
    (out / "train.txt").write_text("\n\n".join(train) + "\n")
    held = [tmpl.format(t=t) for t in HELDOUT_TOPICS for tmpl in HELDOUT_TEMPLATES]
    rng.shuffle(held)
    (out / "heldout.jsonl").write_text("".join(json.dumps(p) + "\n" for p in held))
    (out / "tune.jsonl").write_text("".join(json.dumps(p) + "\n" for p in TUNE))
    print(f"{len(train)} training prompts, {len(held)} held-out prompts, {len(TUNE)} tree-tuning prompts in {out}")


if __name__ == "__main__":
    main()
