"""Chat prompts: the tokenizer's own chat template, rendered the way transformers renders it.

The template comes from the build's tokenizer folder: `chat_template.jinja` (transformers 5 saves it
there) or `chat_template` in tokenizer_config.json (a string, or a list of named templates of which
"default" is used). It is rendered in jinja2's immutable sandbox with `messages`,
`add_generation_prompt=True`, the tokenizer's special tokens, `raise_exception` and `strftime_now`
(what transformers' apply_chat_template provides), and the text is encoded without adding special
tokens again (a template writes its own BOS).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from specexport._optional import require
from specexport.errors import SpecexportError


class ChatTemplate:
    def __init__(self, source: str, special: dict):
        jinja2 = require("jinja2")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as err:
            raise SpecexportError(f"chat template: not a valid jinja2 template ({err})") from None
        self.special = special

    def render(self, messages: list[dict]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special)
        except SpecexportError:
            raise
        except Exception as err:            # the template's own checks (raise_exception) or a bad message
            raise SpecexportError(f"messages: the chat template could not render them ({err})") from None


def user_prompt(build_dir: Path, manifest: dict, text: str) -> str:
    """`text` as one user message in a build's chat template (what a chat client sends); an error
    naming the build when its tokenizer has none."""
    template = load_chat_template(Path(build_dir) / manifest["tokenizer"]["dir"])
    if template is None:
        raise SpecexportError(f"chat: the tokenizer of {build_dir} has no chat template")
    return template.render([{"role": "user", "content": text}])


def load_chat_template(tokenizer_dir: Path) -> ChatTemplate | None:
    """The build's chat template, or None when the tokenizer has none."""
    return _load(str(tokenizer_dir))


@lru_cache(maxsize=8)
def _load(tokenizer_dir: str) -> ChatTemplate | None:
    folder = Path(tokenizer_dir)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    source = None
    if (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    elif isinstance(config.get("chat_template"), str):
        source = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        source = named.get("default")
    if not source:
        return None
    special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return ChatTemplate(source, {k: v for k, v in special.items() if v is not None})


def _token_text(value):
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _raise(message):
    raise SpecexportError(f"messages: {message}")
