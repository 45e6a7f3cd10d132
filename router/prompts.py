"""The token ids of an OpenAI-style request, as the engine will see them.

Completions: a `prompt` string is encoded with the model's tokenizer (with
its special tokens, as vLLM and SGLang do); token ids are taken as they are;
of a batch of prompts the first is routed on. Chat: `messages` go through
the tokenizer's chat template with the generation prompt (and `tools`,
`chat_template_kwargs` when given), as the engines render them.

A request these rules cannot tokenize is not refused here: the engine is
the judge of what it accepts. `PromptError` says why it was not
tokenized, and the proxy routes it by load alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast


class PromptError(ValueError):
    """The request has no prompt this tokenizer can turn into ids."""


class PromptTokenizer:
    def __init__(self, path: str | Path) -> None:
        """The tokenizer saved in the local directory `path` (nothing is
        downloaded); OSError if there is none."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def completion(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_ids(prompt):
            prompt = prompt[0]  # a batch: route on its first prompt
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, list) and _is_ids(prompt):
            return prompt
        raise PromptError("prompt must be a string, token ids, or a list of them")

    def chat(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise PromptError("messages must be a list of objects")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise PromptError("chat_template_kwargs must be an object")
        try:
            out = self.tokenizer.apply_chat_template(
                messages,
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                tokenize=True,
                **extra,
            )
        except Exception as exc:  # the template's own errors (jinja, missing fields)
            raise PromptError(f"the chat template failed: {exc}") from None
        # tokenize=True: token ids, or a BatchEncoding holding them
        ids = out if isinstance(out, list) else cast(Any, out)["input_ids"]
        if not _is_ids(ids):
            raise PromptError("the chat template gave no token ids")
        return list(ids)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)
