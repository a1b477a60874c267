"""A vLLM engine driven over stdin/stdout, one JSON object a line (lab/vllm_engine.py drives it):
run as a script in vLLM's own environment (.venv-vllm), never imported by kvstreamd (with
engines/vllm_connector.py, the only modules that import vLLM). Its first argument is the model folder,
its second the --kv-transfer-config JSON ("" for none), its third (optional) max_model_len. Each request line is
{"prompts": [[ids...], ...], "max_tokens": N}; each answer is {"tokens": [[ids...], ...],
"seconds": [...]} with each prompt's time alone (run one at a time: its time to first token
when max_tokens is 1)."""
import json
import os
import sys
import time



def main() -> None:
    # answers go to the real stdout; everything vLLM (and its child processes) print, to stderr
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    folder, transfer = sys.argv[1], sys.argv[2]
    max_model_len = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    extra = {"kv_transfer_config": KVTransferConfig(**json.loads(transfer))} if transfer else {}
    llm = LLM(model=folder, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
              enable_prefix_caching=False, **extra)
    print(json.dumps({"ready": True}), file=answers)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0)
        tokens, seconds = [], []
        for ids in req["prompts"]:
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            seconds.append(time.perf_counter() - t)
            tokens.append(list(out[0].outputs[0].token_ids))
        print(json.dumps({"tokens": tokens, "seconds": seconds}), file=answers)


if __name__ == "__main__":
    main()
