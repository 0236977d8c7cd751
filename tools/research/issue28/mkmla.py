import json, sys, torch
from pathlib import Path
from transformers import DeepseekV2Config, AutoModelForCausalLM
d = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/helpers/scratch/tiny_mla")
cfg = DeepseekV2Config(
    vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2,
    max_position_embeddings=4096, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, rope_theta=10000.0,
)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
m.save_pretrained(d)
print(d, sum(p.numel() for p in m.parameters()))
print(json.loads((d / "config.json").read_text()))
