"""Train the demo target from scratch on the Python standard library (seeded, CPU).

    python examples/demo/train_demo.py [--steps 700] [--out examples/demo/models]

1. Files: every *.py of this Python's standard library outside test, idlelib and site-packages,
   sorted. A file whose path hashes to 0 mod 25 is held out: it never enters training, and the
   measuring prompts (prompts/code.jsonl) are cut from those files.
2. Tokenizer: byte-level BPE (`tokenizers`), 2048 tokens, trained on the training files.
3. Target: Llama, 8 layers x 320, 5 heads of 64 (1 KV head), SwiGLU 768, tied embeddings (~8.5M
   parameters), trained with AdamW on 256-token windows, then saved in fp16 safetensors.
4. With `--init DIR --layers N` (the second stage in make_demo.sh): the model in DIR is deepened to
   N layers by inserting identity blocks (a copy of its neighbour's weights with the attention output
   and MLP down projections zeroed, as in LLaMA Pro's block expansion), so training resumes from the
   same function, and all layers train on. Depth buys a costlier target step within the 25 MB
   budget of the shipped weights more cheaply than training a deeper model from scratch.
The draft is then made with `specexport distill-draft` (see make_demo.sh beside this file).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).parent
SKIP = ("test", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip")


def stdlib_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not any(s in p.relative_to(root).parts[0] for s in SKIP)
                   and "test" not in p.relative_to(root).parts)
    held = [p for p in files if int(hashlib.md5(str(p.relative_to(root)).encode()).hexdigest(), 16) % 25 == 0]
    return [p for p in files if p not in held], held


def train_tokenizer(files: list[Path], vocab: int) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((p.read_text(errors="replace") for p in files), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def token_stream(files, tokenizer) -> np.ndarray:
    ids = []
    for p in files:
        ids += tokenizer(p.read_text(errors="replace"), add_special_tokens=True)["input_ids"] + [2]
    return np.asarray(ids, dtype=np.int64)


def write_prompts(held: list[Path], rng) -> None:
    prompts = []
    for p in held:
        text = p.read_text(errors="replace")
        starts = [i for i in range(len(text)) if text.startswith("\ndef ", i) or text.startswith("\n    def ", i)]
        for s in rng.permutation(starts)[:2] if starts else []:
            prompts.append(text[s + 1:s + 1 + 240])
    general = ["The quick brown fox", "In this tutorial we will", "Once upon a time", "The results show that"]
    (HERE / "prompts").mkdir(exist_ok=True)
    (HERE / "prompts" / "code.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts[:40]))
    (HERE / "prompts" / "general.jsonl").write_text("".join(json.dumps(p) + "\n" for p in general))


def expand_depth(model: transformers.LlamaForCausalLM, layers: int) -> None:
    """Insert identity blocks spread evenly among the existing layers until there are `layers`."""
    import copy
    old = list(model.model.layers)
    extra = layers - len(old)
    if extra < 0:
        raise SystemExit(f"--layers {layers}: the model in --init already has {len(old)} layers")
    after = {int((j + 1) * len(old) / (extra + 1)) - 1 for j in range(extra)}     # insert after these
    if len(after) != extra:
        raise SystemExit(f"--layers {layers}: at most {2 * len(old)} (one new block per existing layer)")
    new = []
    for i, layer in enumerate(old):
        new.append(layer)
        if i in after:
            block = copy.deepcopy(layer)
            torch.nn.init.zeros_(block.self_attn.o_proj.weight)
            torch.nn.init.zeros_(block.mlp.down_proj.weight)
            new.append(block)
    for i, layer in enumerate(new):
        layer.self_attn.layer_idx = i
    model.model.layers = torch.nn.ModuleList(new)
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[0]] * layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "models"))
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", help="continue from this checkpoint (its tokenizer is kept)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args()
    start = time.time()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train_files, held = stdlib_files()
    if not args.init:                       # the measuring prompts come from the first stage only
        write_prompts(held, rng)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "train_files.txt").write_text("".join(f"{p}\n" for p in train_files))
    if args.init:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.init)
        model = transformers.LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        expand_depth(model, args.layers)
    else:
        tokenizer = train_tokenizer(train_files, 2048)
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=320, intermediate_size=768, num_hidden_layers=args.layers,
            num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model = transformers.LlamaForCausalLM(config)
    data = token_stream(train_files, tokenizer)
    print(f"{len(train_files)} training files, {len(held)} held out, {len(data):,} tokens, "
          f"{len(model.model.layers)} layers", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    log = []
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(data) - args.seq_len - 1, args.batch)
        x = torch.from_numpy(np.stack([data[s:s + args.seq_len + 1] for s in starts]))
        logits = model(x[:, :-1]).logits                                    # [B, S, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append(round(float(loss.detach()), 4))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step} loss {log[-1]:.3f} lr {lr:.2e} {time.time() - start:.0f}s", flush=True)
    out = Path(args.out) / "target"
    model.to(torch.float16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = Path(args.out) / "target_training.json"
    previous = json.loads(record.read_text()) if args.init and record.is_file() else None
    stages = previous.get("stages", [previous]) if previous else []
    stages.append({
        "init": args.init, "layers": args.layers, "seed": args.seed, "lr": args.lr,
        "seconds": round(time.time() - start), "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
        "tokens_seen": args.steps * args.batch * args.seq_len, "corpus_tokens": int(len(data)),
        "final_loss_mean_last_10": float(np.mean(log[-10:])), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "loss": log})
    record.write_text(json.dumps({"stages": stages}, indent=1))
    print(f"wrote {out} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
