"""Make a tiny random-weight Llama that the real vLLM serves on a CPU, with no download.

usage: python runbooks/vllm-local/make_tiny_model.py OUT_DIR [--slow]
(with a python that has torch, transformers and tokenizers: vLLM's own; ci/install-vllm.sh
runs it with .cache/vllm-venv/bin/python)

What it makes, and why each number:
- 2 layers, hidden 128, 4 heads: vLLM's CPU attention needs a head size of at least 32;
- bf16 weights, tied embeddings: under 1 MB on disk, loaded in well under a second;
- max_position_embeddings 32768: long generations are possible (the busy-engine tests);
- a byte-level BPE tokenizer trained here with `tokenizers` (nothing is fetched), wrapped as
  PreTrainedTokenizerFast with a chat template, so /v1/chat/completions works as it does for a
  real model. Its alphabet is the corpus's printable ASCII only (other bytes of a prompt become
  <unk>), so whatever the random model says is ASCII: never U+2028 or U+0085, which SSE clients
  that split lines like `str.splitlines` (httpx's `iter_lines`, httpx-sse) break frames at.
Random weights answer gibberish; the tests care about the engine, not the words.

`--slow` makes the same model with 8 layers, hidden 512 and 65536 positions: its prefill of
30,000 tokens takes ~19 s on the CPU (the tiny one: ~2 s), so that a long prefill, during which
no token counter moves, can be tested against the hang detection.
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 512  # the tokenizer's target; the model's vocabulary is what it learns
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# What the tokenizer learns its merges from: the kind of text a Ralph loop sends.
CORPUS = [
    "Read PLAN.md and CHECKLIST.md. Do exactly this one item, then tick it and commit.",
    "- [ ] add a test for the parser\n- [x] write the README\n- [!] skipped item",
    "def main():\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    "git commit -m 'item done' && git log --oneline -5",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "<|system|>\nYou are a coding agent.\n<|user|>\nHello\n<|assistant|>\nOK\n",
]


def train_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE over the corpus's ASCII: every token the model can emit decodes to
    ASCII text (random weights emit any token), and any prompt still encodes (<unk>)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=65536,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, slow: bool) -> LlamaForCausalLM:
    """Random weights from a fixed seed, so every install makes the same model."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # every id the model can emit decodes
        hidden_size=512 if slow else 128,
        intermediate_size=1024 if slow else 256,
        num_hidden_layers=8 if slow else 2,
        num_attention_heads=8 if slow else 4,  # head size 64 / 32
        num_key_value_heads=8 if slow else 4,
        max_position_embeddings=65536 if slow else 32768,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def main(out: Path, slow: bool) -> None:
    tokenizer = train_tokenizer()
    model = build_model(tokenizer, slow)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(json.dumps({"model": str(out), "bytes": size, "vocab": len(tokenizer)}))


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["--slow"]):
        sys.exit(__doc__)
    main(Path(sys.argv[1]), slow=sys.argv[2:] == ["--slow"])
