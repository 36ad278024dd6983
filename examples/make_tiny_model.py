"""Build a tiny random-weight Llama and a locally trained tokenizer, offline.

Used by the demo, the tests and the benchmarks: no download is possible on our
machines. The tokenizer is a byte-level BPE trained on local text (the Python
standard library sources); the model is a randomly initialised Llama with a
fixed seed, so every build of the same preset is bit-identical.

    python examples/make_tiny_model.py --out .models/tiny [--preset tiny|bench] [--seed 0]

Presets:
- ``tiny``: 4 layers, 2 KV heads, head dim 64 (64 KiB per 128-token block per
  layer in bf16). Fast enough for end-to-end tests on 2 cores.
- ``bench``: 16 layers, 8 KV heads, head dim 128 (a realistic 64 KiB of KV per
  token), with a narrow MLP so it still runs fast on CPU.
- ``gpu``: the GPU check's model (``vllm_pd_ext/testing/gpu_check.py``): 24
  layers, 8 KV heads, head dim 128 (96 KiB of KV per token, 3 GiB for a 32k
  prompt), hidden 2048, 40,960 positions; about 1.2 GB of bf16 weights.
- ``gpu-dry``: the same head shape in 2 layers (the check's ``--dry-run``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

PRESETS = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "bench": dict(hidden_size=1024, intermediate_size=256, num_hidden_layers=16,
                  num_attention_heads=8, num_key_value_heads=8, head_dim=128),
    "gpu": dict(hidden_size=2048, intermediate_size=2048, num_hidden_layers=24,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960),
    "gpu-dry": dict(hidden_size=1024, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                    max_position_embeddings=40960),
}
VOCAB_SIZE = 3072
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def _corpus_files(limit: int = 170) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))[:limit]
    licenses = sorted(str(p) for p in Path("/usr/share/common-licenses").glob("*"))
    return files + [p for p in licenses if os.path.isfile(p)]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus_files(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path, preset: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape: dict[str, int] = {"max_position_embeddings": 4096, **PRESETS[preset]}
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
        # A 0.1 spread (not the default 0.02) makes every prompt block change
        # the greedy output, which the equality tests rely on.
        initializer_range=0.1, torch_dtype="bfloat16", **shape,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    stamp = out / "pd_ext_model.json"
    want = {"preset": args.preset, "seed": args.seed, "version": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        print(f"model already built: {out}")
        return 0
    # Built aside and renamed into place: test processes running in
    # parallel may build the same model, and an engine must never read a
    # half-written one.
    tmp = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp)
    build_model(tmp, args.preset, args.seed)
    (tmp / stamp.name).write_text(json.dumps(want))
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        shutil.rmtree(tmp)  # another process built it meanwhile
    else:
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    print(f"built {args.preset} model (seed {args.seed}) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
