import os, sys, time, json
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
T0 = time.perf_counter()
def main():
    tp = int(sys.argv[1]); dp = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    events = len(sys.argv) > 3 and sys.argv[3] == "events"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = dict(model="/tmp/helpers/scratch/tiny_llama", skip_tokenizer_init=True, enforce_eager=True,
              block_size=32, seed=0, max_model_len=4096, tensor_parallel_size=tp)
    if dp > 1:
        kw["data_parallel_size"] = dp
    if events:
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": "tcp://*:5557", "topic": ""}
    llm = LLM(**kw)
    t1 = time.perf_counter(); print(f"STARTUP {t1-T0:.1f}s", flush=True)
    import random
    rng = random.Random(0); base = [rng.randrange(10, 1000) for _ in range(200)]
    prompts = [base + [rng.randrange(10, 1000) for _ in range(40)] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, detokenize=False)
    for p in prompts:
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
        print("OUT", list(o.outputs[0].token_ids), "cached", o.num_cached_tokens, flush=True)
    print(f"GEN {time.perf_counter()-t1:.1f}s", flush=True)
    time.sleep(1)
if __name__ == "__main__":
    main()
