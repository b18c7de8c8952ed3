"""Write a Hugging Face model directory as a GGUF file with llama.cpp's own converter.

usage: python ci/make_tiny_gguf.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf
(with a python that has torch, numpy and transformers: the vLLM tier's .cache/vllm-venv;
ci/install-llamacpp.sh runs it on .cache/tiny-model and .cache/slow-model)

LLAMA_CPP_DIR is a llama.cpp source tree (the one vendored in llama-cpp-python's sdist): its
`convert_hf_to_gguf.py` and its own `gguf-py`, so the file matches the server built from the
same tree. One change: the converter names a BPE tokenizer's pre-tokenizer by hashing how it
splits a test string, and refuses one it has never seen ("BPE pre-tokenizer was not
recognized"), as the tiny models' tokenizer is (trained by make_tiny_model.py). It is a plain
byte-level BPE, which llama.cpp calls `gpt-2`: the name is given, not guessed.
"""

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__.split("\n\n")[1])
    tree, model, out = (Path(arg).resolve() for arg in sys.argv[1:])
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    from conversion.base import TextModel  # the tree's own, found through sys.path

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = [str(tree / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out)]
    sys.argv += ["--outtype", "f32"]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
