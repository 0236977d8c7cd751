import os, sys, time, json, random
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
T0 = time.perf_counter()
def main():
    tp = int(sys.argv[1]); model = sys.argv[2]; store = sys.argv[3]; bs = int(sys.argv[4])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=bs,
              seed=0, max_model_len=4096, tensor_parallel_size=tp, disable_log_stats=False)
    if store != "none":
        kw["kv_transfer_config"] = {"kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": {"kind": "posix", "path": store, "capacity_gb": 1}, "block_tokens": 64}}
    llm = LLM(**kw)
    t1 = time.perf_counter(); print(f"STARTUP {t1-T0:.1f}s", flush=True)
    rng = random.Random(0); base = [rng.randrange(10, 1000) for _ in range(int(os.environ.get("BASE","600")))]
    prompts = [base + [rng.randrange(10, 1000) for _ in range(40)] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, detokenize=False)
    for p in prompts:
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
        print("OUT", list(o.outputs[0].token_ids), "cached", o.num_cached_tokens, "lp", [round(sorted((x.logprob for x in lp.values()), reverse=True)[0],4) for lp in o.outputs[0].logprobs], "margin", [round((lambda r: r[0]-r[1])(sorted((x.logprob for x in lp.values()), reverse=True)),4) for lp in o.outputs[0].logprobs], flush=True)
    print(f"GEN {time.perf_counter()-t1:.1f}s", flush=True)
    for m in llm.get_metrics():
        if m.name.startswith("vllm:ucm_") and getattr(m, "value", None):
            print("METRIC", m.name, getattr(m, "labels", ""), m.value)
if __name__ == "__main__":
    main()
