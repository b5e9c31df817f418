"""Prompt token ids: the cartridges' prefix first, then the request's prompt or chat turns.

Rules:
- The BOS slot belongs to what comes first: with a cartridge prefix, the prompt adds no BOS.
- After a first-k or token cartridge, chat turns are rendered with the model's chat template
  (its default system block included, as for any request).
- After a trained cartridge, the Cartridges convention: the cartridge's first token is its
  attention sink and the user turn comes right after it, with no BOS and no default system block
  (Llama 3.1's template inserts a dated system message; training never saw it). Built in for
  Llama-3-style and ChatML templates; `GatewaySettings.trained_chat_template` overrides it per
  deployment ("model": the model's own template minus BOS, or any Jinja chat template).

Runs in the gateway process (owns the tokenizer, loaded once), and in `lmcache-cartridge train`,
whose student sees exactly the prompt the gateway will build after the trained cartridge.
"""

from __future__ import annotations

from typing import Sequence

from lmcache_cartridge.api.settings import RequestError

# The user turn right after the cartridge: every message as the model family's turn, nothing before.
LLAMA3_AFTER_TRAINED = (
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML_AFTER_TRAINED = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class PromptBuilder:
    """Tokenizer-side work. Owned by the app; the tokenizer is loaded once."""

    def __init__(self, tokenizer, trained_chat_template: str | None = None) -> None:
        """`tokenizer`: a model directory (loaded here) or an already loaded tokenizer."""
        if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tok = tokenizer
        self.bos = self.tok.bos_token_id
        # The cartridge owns the BOS slot only where the tokenizer puts a BOS before text (Llama:
        # the cartridge starts with it). SmolLM2's BOS token is ChatML's <|im_start|>, which its
        # tokenizer never prepends: there a template's leading <|im_start|> is the turn's own.
        self.cartridge_owns_bos = self.bos is not None and self.tok("a")["input_ids"][:1] == [self.bos] \
            and self.tok("a", add_special_tokens=False)["input_ids"][:1] != [self.bos]
        self.after_trained = self._after_trained_template(trained_chat_template)

    def _after_trained_template(self, option: str | None) -> str | None:
        """The Jinja template for chat after a trained cartridge; None: the model's own."""
        if option == "model":
            return None
        if option:
            return option
        vocab = self.tok.get_vocab()
        if "<|start_header_id|>" in vocab:
            return LLAMA3_AFTER_TRAINED
        if "<|im_start|>" in vocab:
            return CHATML_AFTER_TRAINED
        return None  # an unknown family: its own template, BOS dropped

    def completion_ids(self, prompt: str | list[int], prefix: Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tok(prompt, add_special_tokens=not prefix)["input_ids"]
        else:
            ids = list(prompt)
        return list(prefix) + ids

    def chat_ids(self, messages: list[dict], prefix: Sequence[int], *, after_trained: bool = False) -> list[int]:
        template = self.after_trained if after_trained else None
        try:
            ids = self.tok.apply_chat_template(messages, chat_template=template,
                                               add_generation_prompt=True, tokenize=True)
        except Exception as e:  # no chat template, or one that rejects these roles/order
            raise RequestError(400, f"the chat template rejected 'messages': {type(e).__name__}: {e}") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        if (prefix or after_trained) and self.cartridge_owns_bos and ids and ids[0] == self.bos:
            ids = ids[1:]
        return list(prefix) + ids
