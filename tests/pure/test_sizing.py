"""sizing.py and vllm-pd-size: the seed's worked example, exactly, and the
model configs it must size or refuse by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_pd_ext.tools.sizing.cli import main
from vllm_pd_ext.tools.sizing.formula import KVSpec, SizingError, handoff, report, spec_from_config

SEED = KVSpec(layers=80, kv_heads=8, head_dim=128, bytes_per_element=2)
LLAMA_70B = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "hidden_size": 8192, "torch_dtype": "bfloat16"}


def test_the_seed_worked_example_exactly():
    assert SEED.bytes_per_token == 327_680
    size = handoff(SEED, 2000, [100, 25, 10], setup_ms=1.0, budget_ms=20.0)
    assert size.kv_bytes == 655_360_000 and size.kv_mib == 625
    floors = [round(link.handoff_floor_ms, 4) for link in size.links]
    assert floors == [7.5536, 27.2144, 66.5360]
    assert [link.within_budget for link in size.links] == [True, False, False]
    assert [round(link.bandwidth_floor_ms, 4) for link in size.links] == [6.5536, 26.2144,
                                                                          65.536]
    out = report(SEED, [2000], [100, 25, 10], 1.0, 20.0, short_tokens=300)
    assert round(out["short_prompt_case"]["handoff_floor_ms"], 4) == 10.8304
    assert out["short_prompt_case"]["effective_bandwidth_gb_s"] == 10
    # FP8 KV as the sensitivity case: half the bytes.
    assert out["sensitivity"]["bytes_per_token"] == 163_840


def test_config_gqa_head_dim_derived_and_explicit():
    spec = spec_from_config(LLAMA_70B)
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (80, 8, 128)
    assert spec.bytes_per_token == 327_680
    explicit = spec_from_config({**LLAMA_70B, "head_dim": 256, "hidden_size": 5120})
    assert explicit.head_dim == 256
    mha = spec_from_config({k: v for k, v in LLAMA_70B.items() if k != "num_key_value_heads"})
    assert mha.kv_heads == 64  # no num_key_value_heads: one KV head per attention head
    fp8 = spec_from_config(LLAMA_70B, kv_dtype="fp8")
    assert fp8.bytes_per_token == 163_840
    nested = spec_from_config({"architectures": ["X"], "text_config": LLAMA_70B})
    assert nested.bytes_per_token == 327_680


def test_config_mla_latent_kv():
    deepseek = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "torch_dtype": "bfloat16"}
    spec = spec_from_config(deepseek)
    assert spec.latent_dim == 576
    assert spec.bytes_per_token == 61 * 576 * 2  # one latent per layer, not K and V per head


@pytest.mark.parametrize(("cfg", "field"), [
    ({k: v for k, v in LLAMA_70B.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    ({**LLAMA_70B, "num_attention_heads": 0}, "num_attention_heads"),
    ({**LLAMA_70B, "torch_dtype": "float6"}, "torch_dtype"),
    ({k: v for k, v in LLAMA_70B.items() if k != "torch_dtype"}, "torch_dtype"),
    ({**LLAMA_70B, "hidden_size": 8193}, "hidden_size"),
    ({**LLAMA_70B, "layers_block_type": ["attention", "mamba"]}, "layers_block_type"),
    ({**LLAMA_70B, "num_key_value_heads": "8"}, "num_key_value_heads"),
])
def test_refuses_what_it_cannot_size_naming_the_field(cfg, field):
    with pytest.raises(SizingError, match=field):
        spec_from_config(cfg)


def test_cli_json_and_errors(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_70B))
    main(["--model", str(model), "--tokens", "2000", "--link", "10", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 327_680
    assert round(out["prompts"][0]["links"][0]["handoff_floor_ms"], 4) == 66.536
    main(["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--kv-dtype", "bf16"])
    table = capsys.readouterr().out
    assert "| 2000 | 655,360,000 | 625.0 | 25 | 26.2144 | 27.2144 | no |" in table
    assert "10.8304 ms" in table
    with pytest.raises(SystemExit) as exc:
        main(["--layers", "80"])
    assert exc.value.code == 2
    assert "--kv-dtype" in capsys.readouterr().err
    (model / "config.json").write_text("{not json")
    with pytest.raises(SystemExit):
        main(["--model", str(model)])
    assert "not readable JSON" in capsys.readouterr().err


def test_cli_reader_closing_the_pipe_is_not_a_traceback():
    """`vllm-pd-size ... | grep -q X` closes the pipe early: the command ends
    quietly (status 1, nothing on stderr), as CI's packaging check found."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from vllm_pd_ext.tools.sizing.cli import main; main()",
         "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--kv-dtype", "bf16",
         *[a for n in range(200, 4200, 200) for a in ("--tokens", str(n))]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first byte is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
