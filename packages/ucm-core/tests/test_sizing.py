"""KV sizing from a model's config.json (ucm.core.sizing) and ``ucm model-id --size``.

Every figure is checked against a computation by hand.  The per-token bytes were also
checked once against vLLM 0.32's own geometry (``ModelConfig.get_num_kv_heads`` and
``get_head_size``, ``FullAttentionSpec``/``MLAAttentionSpec.page_size_bytes``) for the
Llama-3.1-8B and DeepSeek-V3 configurations below, at 1, 4 (fp8), 8 and 16 ranks: they agree.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ucm.core.block_format import HEADER_BYTES
from ucm.core.cli import main
from ucm.core.settings import GIB
from ucm.core.sizing import SizingError, kv_shape, kv_size, model_kv_size, read_model_config

# The fields of the published config.json files that sizing reads.
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}
LLAMA_3_1_70B = {
    **LLAMA_3_1_8B,
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
del LLAMA_3_1_70B["head_dim"]  # derived: hidden_size / num_attention_heads = 128
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,  # named, but off
    "use_sliding_window": False,
    "max_window_layers": 28,
    "torch_dtype": "bfloat16",
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_V0_3 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "torch_dtype": "bfloat16",
}
GEMMA_3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "sliding_window": 1024,  # the pattern is transformers' default for gemma3_text: 6
    },
}

#: the models of the table in docs/sizing.md
DOC_MODELS = {
    "Llama-3.1-8B": LLAMA_3_1_8B,
    "Llama-3.1-70B": LLAMA_3_1_70B,
    "Qwen2.5-7B": QWEN2_5_7B,
    "Qwen3-8B": QWEN3_8B,
    "Mistral-7B-v0.3": MISTRAL_7B_V0_3,
    "DeepSeek-V3": DEEPSEEK_V3,
    "DeepSeek-V2-Lite": DEEPSEEK_V2_LITE,
    "gpt-oss-20b": GPT_OSS_20B,
    "Gemma-3-27B": GEMMA_3_27B,
}
DOCS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "sizing.md"


def size_of(config: dict, **options) -> object:
    return kv_size(kv_shape(config), **options)


def write_model(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- bytes per token -------------------------------------------------------------------------


def test_llama_3_1_8b_by_hand():
    size = size_of(LLAMA_3_1_8B)
    # 32 layers x (K and V) x 8 heads x 128 values x 2 bytes
    assert size.bytes_per_token_layer == 2 * 8 * 128 * 2 == 4096
    assert size.bytes_per_token == 32 * 4096 == 131072
    assert size.shape.attention == "GQA"
    assert size.block_tokens == 256
    assert size.block_payload_bytes == 256 * 131072 == 32 << 20
    assert size.block_bytes == (32 << 20) + HEADER_BYTES == (32 << 20) + 4096
    # 100 GiB: 3199 whole blocks of 32 MiB + 4 KiB
    held = size.holds(100 * GIB)
    assert held.blocks == 100 * GIB // ((32 << 20) + 4096) == 3199
    assert held.tokens == 3199 * 256


def test_head_dim_derived_from_hidden_size():
    size = size_of(LLAMA_3_1_70B)
    assert size.shape.head_dim == 8192 // 64 == 128
    assert size.bytes_per_token == 80 * 2 * 8 * 128 * 2 == 327680


def test_qwen2_gqa_with_its_window_turned_off():
    size = size_of(QWEN2_5_7B)
    # 28 layers x 2 x 4 KV heads x (3584 / 28 = 128) x 2 bytes
    assert size.shape.head_dim == 128 and size.shape.kv_heads == 4
    assert size.bytes_per_token == 28 * 2 * 4 * 128 * 2 == 57344
    assert size.shape.window_layers == 0 and size.notes == ()


def test_mha_when_no_kv_heads_are_named():
    config = {k: v for k, v in LLAMA_3_1_8B.items() if k != "num_key_value_heads"}
    size = size_of(config)
    assert size.shape.attention == "MHA" and size.shape.kv_heads == 32
    assert size.bytes_per_token == 32 * 2 * 32 * 128 * 2


def test_deepseek_v3_mla_one_latent_per_layer():
    size = size_of(DEEPSEEK_V3)
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes; no separate K and V
    assert size.shape.attention == "MLA"
    assert size.bytes_per_token_layer == (512 + 64) * 2 == 1152
    assert size.bytes_per_token == 61 * 1152 == 70272
    assert any("num_nextn_predict_layers 1" in n for n in size.notes)


def test_deepseek_v2_lite_mla():
    assert size_of(DEEPSEEK_V2_LITE).bytes_per_token == 27 * (512 + 64) * 2 == 31104


def test_kv_cache_dtype_override():
    assert size_of(LLAMA_3_1_8B, kv_cache_dtype="fp8").bytes_per_token == 65536
    assert size_of(LLAMA_3_1_8B, kv_cache_dtype="fp8_e5m2").bytes_per_token == 65536
    assert size_of(LLAMA_3_1_8B, kv_cache_dtype="float16").bytes_per_token == 131072
    assert size_of(LLAMA_3_1_8B, kv_cache_dtype="float32").bytes_per_token == 262144
    assert size_of(DEEPSEEK_V3, kv_cache_dtype="fp8").bytes_per_token == 61 * 576
    # DeepSeek's fp8 MLA layout: 512 fp8 + 4 float32 scales + 64 bf16 rope values = 656 B
    assert size_of(DEEPSEEK_V3, kv_cache_dtype="fp8_ds_mla").bytes_per_token == 61 * 656
    with pytest.raises(SizingError, match="fp8_ds_mla is DeepSeek's MLA layout"):
        size_of(LLAMA_3_1_8B, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(SizingError, match="'int3' is not sized here"):
        size_of(LLAMA_3_1_8B, kv_cache_dtype="int3")


def test_a_float32_checkpoint_is_served_in_16_bits():
    size = size_of({**LLAMA_3_1_8B, "torch_dtype": "float32"})
    assert size.kv_cache_dtype == "bfloat16" and size.bytes_per_token == 131072
    assert any("float32 checkpoint" in n for n in size.notes)
    # the newer spelling of the field
    config = {k: v for k, v in LLAMA_3_1_8B.items() if k != "torch_dtype"}
    assert size_of({**config, "dtype": "float16"}).kv_cache_dtype == "float16"


# --- tensor parallelism ----------------------------------------------------------------------


def test_tp_splits_the_kv_heads():
    size = size_of(LLAMA_3_1_8B, tensor_parallel_size=4)
    # 2 heads per rank: a quarter of the bytes on each, four blocks per 256 tokens
    assert size.kv_heads_per_rank == 2
    assert size.bytes_per_token == 131072 // 4 == 32768
    assert size.writers == 4
    assert size.block_bytes == 256 * 32768 + 4096
    held = size.holds(100 * GIB)
    boundaries = 100 * GIB // (4 * (256 * 32768 + 4096))
    assert held.blocks == 4 * boundaries and held.tokens == 256 * boundaries
    # every rank's header counted: a little more than the model's bytes per token
    assert size.stored_bytes_per_token == 4 * (256 * 32768 + 4096) / 256 == 131072 + 64


def test_fewer_kv_heads_than_ranks_replicates_them():
    size = size_of(LLAMA_3_1_8B, tensor_parallel_size=16)
    # one head on every rank (each of the 8 on two ranks), each rank storing its own
    assert size.kv_heads_per_rank == 1 and size.writers == 16
    assert size.bytes_per_token == 32 * 2 * 1 * 128 * 2 == 16384
    assert size.writers * size.bytes_per_token == 2 * 131072
    assert any("8 KV heads on 16 ranks" in n for n in size.notes)


def test_mla_is_the_same_on_every_rank_and_stored_once():
    one, eight = size_of(DEEPSEEK_V3), size_of(DEEPSEEK_V3, tensor_parallel_size=8)
    assert eight.bytes_per_token == one.bytes_per_token == 70272
    assert eight.writers == 1 and eight.holds(GIB) == one.holds(GIB)


def test_tp_sizes_vllm_refuses_are_refused():
    # more heads than ranks: the ranks must divide them; fewer: they must divide the ranks
    with pytest.raises(SizingError, match="num_key_value_heads 6 cannot be split across 4"):
        size_of({**LLAMA_3_1_8B, "num_key_value_heads": 6}, tensor_parallel_size=4)
    with pytest.raises(SizingError, match="num_key_value_heads 3 cannot be split across 8"):
        size_of({**LLAMA_3_1_8B, "num_key_value_heads": 3}, tensor_parallel_size=8)
    assert size_of({**QWEN2_5_7B, "num_attention_heads": 32}, tensor_parallel_size=8).writers == 8
    with pytest.raises(SizingError, match="num_attention_heads 28 cannot be split across 8"):
        size_of(QWEN2_5_7B, tensor_parallel_size=8)


# --- window layers ---------------------------------------------------------------------------


def test_layer_types_split_full_and_window_layers():
    size = size_of(GPT_OSS_20B)
    shape = size.shape
    assert (shape.full_layers, shape.window_layers, shape.window_tokens) == (12, 12, 128)
    # bytes per token count the full-attention layers; the window layers go in tails
    assert size.bytes_per_token == 12 * 2 * 8 * 64 * 2 == 24576
    assert size.tail_tokens == 128
    assert size.tail_bytes == 128 * 24576 + 4096
    held = size.holds(100 * GIB)  # half to the tails by default (wa_capacity_fraction)
    assert held.full_capacity_bytes == held.window_capacity_bytes == 50 * GIB
    assert held.tokens == 50 * GIB // (256 * 24576 + 4096) * 256
    assert held.tails == 50 * GIB // (128 * 24576 + 4096)
    assert size.holds(100 * GIB, wa_capacity_fraction=0.25).full_capacity_bytes == 75 * GIB


def test_gemma3_pattern_inside_text_config():
    size = size_of(GEMMA_3_27B)
    shape = size.shape
    # every 6th layer is full attention: 6, 12, ..., 60 of 62
    assert (shape.full_layers, shape.window_layers, shape.window_tokens) == (10, 52, 1024)
    assert size.bytes_per_token == 10 * 2 * 16 * 128 * 2 == 81920
    assert size.tail_bytes == 1024 * 52 * 2 * 16 * 128 * 2 + 4096
    assert any("text_config" in n for n in size.notes)


def test_an_explicit_pattern_and_gemma2s_default_one():
    text = {**GEMMA_3_27B["text_config"], "sliding_window_pattern": 4, "torch_dtype": "bfloat16"}
    shape = kv_shape(text)
    # 4, 8, ..., 60: 15 full layers of 62
    assert (shape.full_layers, shape.window_layers) == (15, 47)
    gemma2 = {**text, "model_type": "gemma2", "sliding_window": 4096, "num_hidden_layers": 42}
    del gemma2["sliding_window_pattern"]
    shape = kv_shape(gemma2)
    assert (shape.full_layers, shape.window_layers, shape.window_tokens) == (21, 21, 4096)
    assert any("default for gemma2" in n for n in shape.notes)


def test_a_window_without_layer_types_is_a_note():
    size = size_of({**MISTRAL_7B_V0_3, "sliding_window": 4096})
    assert size.shape.window_layers == 0 and size.bytes_per_token == 131072
    assert any("sliding_window 4096 without layer_types" in n for n in size.notes)


def test_the_tiny_test_models_match_what_the_connector_stores():
    # ucm-vllm's end-to-end tests run these models and check the stored files: a plain model
    # block of T tokens is T x 1024 bytes after the header (test_e2e), and the hybrid model's
    # tail is the full block's payload x window / 256 (test_hybrid_e2e)
    from ucm.lab.testing.vllm.models import tiny_llama_config

    plain = size_of(tiny_llama_config(), block_tokens=32)
    assert plain.bytes_per_token == 2 * 2 * 2 * 64 * 2 == 1024
    assert plain.block_bytes == 32 * 1024 + 4096
    hybrid = size_of(tiny_llama_config(hybrid=True, sliding_window=128))
    assert (hybrid.shape.full_layers, hybrid.shape.window_layers) == (2, 2)
    assert hybrid.tail_bytes - 4096 == (hybrid.block_bytes - 4096) * 128 // 256


# --- what a configuration must say -----------------------------------------------------------


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("num_hidden_layers", "config.json has no num_hidden_layers"),
        ("torch_dtype", "config.json has no torch_dtype"),
        (("head_dim", "hidden_size"), "no head_dim, nor hidden_size"),
        (
            ("num_key_value_heads", "num_attention_heads"),
            "neither num_key_value_heads nor num_attention_heads",
        ),
    ],
)
def test_a_missing_field_is_named(drop, message):
    names = drop if isinstance(drop, tuple) else (drop,)
    config = {k: v for k, v in LLAMA_3_1_8B.items() if k not in names}
    with pytest.raises(SizingError, match=message):
        size_of(config)


def test_other_incomplete_configs_are_refused_by_name():
    with pytest.raises(SizingError, match="qk_rope_head_dim, which an MLA model"):
        size_of({k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"})
    with pytest.raises(SizingError, match="sliding_window, which a model with sliding"):
        size_of({k: v for k, v in GPT_OSS_20B.items() if k != "sliding_window"})
    with pytest.raises(SizingError, match="layer_types holds linear_attention"):
        size_of({**GPT_OSS_20B, "layer_types": ["linear_attention", "full_attention"] * 12})
    with pytest.raises(SizingError, match="must list the 24 layers"):
        size_of({**GPT_OSS_20B, "layer_types": ["full_attention"]})
    with pytest.raises(SizingError, match="num_hidden_layers must be a whole number"):
        size_of({**LLAMA_3_1_8B, "num_hidden_layers": "32"})
    with pytest.raises(SizingError, match="'int4' is not one of"):
        size_of({**LLAMA_3_1_8B, "torch_dtype": "int4"})
    # a dtype given by hand needs no torch_dtype
    config = {k: v for k, v in LLAMA_3_1_8B.items() if k != "torch_dtype"}
    assert size_of(config, kv_cache_dtype="bfloat16").bytes_per_token == 131072


def test_reading_the_config(tmp_path):
    folder = write_model(tmp_path / "m", LLAMA_3_1_8B)
    (folder / "model.safetensors").write_bytes(b"x")
    for path in (folder, folder / "config.json", folder / "model.safetensors"):
        assert read_model_config(path) == LLAMA_3_1_8B
    assert model_kv_size(folder, tensor_parallel_size=2).bytes_per_token == 65536
    with pytest.raises(SizingError, match="no such file or folder"):
        read_model_config(tmp_path / "absent")
    with pytest.raises(SizingError, match="no config.json in"):
        read_model_config(tmp_path)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SizingError, match="is not valid JSON"):
        read_model_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(SizingError, match="not an object"):
        read_model_config(tmp_path / "list.json")


# --- the command -----------------------------------------------------------------------------


def test_cli_size_text(tmp_path, capsys):
    folder = write_model(tmp_path / "llama", LLAMA_3_1_8B)
    assert main(["model-id", str(folder), "--size", "--capacity-gb", "100"]) == 0
    out = capsys.readouterr().out
    assert "per token  131072 B (128.0 KiB)" in out
    assert "33554432 B payload + 4096 B header = 33558528 B" in out
    assert "100.0 GiB holds 3199 blocks: 818944 tokens" in out


def test_cli_size_json_with_every_option(tmp_path, capsys):
    folder = write_model(tmp_path / "llama", LLAMA_3_1_8B)
    argv = ["model-id", str(folder), "--size", "--json", "--kv-cache-dtype", "fp8",
            "--tensor-parallel-size", "2", "--block-tokens", "64",
            "--capacity-gb", "10"]  # fmt: skip
    assert main(argv) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["bytes_per_token"] == 131072 // 2 // 2 == 32768
    assert found["bytes_per_token_all_ranks"] == 65536
    assert found["block_bytes"] == 64 * 32768 + 4096
    assert found["blocks_per_boundary"] == 2
    boundaries = 10 * GIB // (2 * (64 * 32768 + 4096))
    assert found["capacity"]["tokens"] == 64 * boundaries
    assert found["capacity"]["blocks"] == 2 * boundaries


def test_cli_size_of_window_and_mla_models(tmp_path, capsys):
    assert main(["model-id", str(write_model(tmp_path / "g", GPT_OSS_20B)), "--size"]) == 0
    out = capsys.readouterr().out
    assert "12 full attention, 12 with a 128-token window" in out
    assert f"tail       128 tokens of the window layers, {128 * 24576 + 4096} B" in out
    ds = write_model(tmp_path / "ds", DEEPSEEK_V3)
    assert main(["model-id", str(ds), "--size", "--tensor-parallel-size", "8"]) == 0
    out = capsys.readouterr().out
    assert (
        "MLA, one latent of 512 + 64 values" in out
        and "on every rank, stored once for all 8" in out
    )


def test_cli_size_errors_are_one_line(tmp_path, capsys):
    incomplete = write_model(tmp_path / "m", {"num_hidden_layers": 2})
    assert main(["model-id", str(incomplete), "--size"]) == 1
    err = capsys.readouterr().err
    assert err == "ucm: config.json has neither num_key_value_heads nor num_attention_heads: " \
        "sizing needs the number of KV heads\n"  # fmt: skip
    assert main(["model-id", str(incomplete), "--size", "--json"]) == 1
    assert "num_key_value_heads" in json.loads(capsys.readouterr().out)["error"]
    assert main(["model-id", str(tmp_path / "absent"), "--size", "--json"]) == 1
    assert "no such file or folder" in json.loads(capsys.readouterr().out)["error"]
    # the sizing options mean nothing without --size
    assert main(["model-id", str(incomplete), "--tensor-parallel-size", "2"]) == 1
    assert "--tensor-parallel-size: only with --size" in capsys.readouterr().err
    llama = write_model(tmp_path / "llama", LLAMA_3_1_8B)
    assert main(["model-id", str(llama), "--size", "--tensor-parallel-size", "3"]) == 1
    assert "cannot be split across 3 ranks" in capsys.readouterr().err


def test_cli_size_refuses_bad_numbers_without_a_traceback(tmp_path):
    folder = write_model(tmp_path / "llama", LLAMA_3_1_8B)
    for option, value in (("--tensor-parallel-size", "0"), ("--block-tokens", "1.5"),
                          ("--capacity-gb", "inf"), ("--kv-cache-dtype", "int3")):  # fmt: skip
        command = ["model-id", str(folder), "--size", option, value]
        done = subprocess.run(
            [sys.executable, "-m", "ucm.core.cli", *command],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (option, done.stderr)
        assert "Traceback" not in done.stderr and option in done.stderr


# --- the docs' table -------------------------------------------------------------------------


def _doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOCS_PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in DOC_MODELS:
            rows[cells[0]] = cells
    return rows


@pytest.mark.skipif(not DOCS_PAGE.is_file(), reason="run from a checkout with docs/")
def test_the_docs_table_is_what_the_function_computes():
    rows = _doc_rows()
    assert set(rows) == set(DOC_MODELS)

    def number(cell: str) -> int:  # the first number of a cell: "33,558,528 (32.0 MiB)"
        found = re.match(r"[0-9,]+", cell)
        assert found, cell
        return int(found.group().replace(",", ""))

    for name, config in DOC_MODELS.items():
        size = size_of(config)
        held = size.holds(100 * GIB)
        _, _layers, _kv, per_token, block, tail, tokens = rows[name]
        assert number(per_token) == size.bytes_per_token, name
        assert number(block) == size.block_bytes, name
        assert (number(tail) if size.tail_bytes else tail) == (size.tail_bytes or "-"), name
        assert number(tokens) == held.tokens, name
