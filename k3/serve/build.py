"""The serving engine of a checkpoint: its model, tokenizer and chat template (`k3 serve`)."""

from __future__ import annotations

import os

import torch


def build_engine(ckpt_dir: str, cache_memory_mb: float | None = None, page_tokens: int | None = None,
                 hash_block_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_step_tokens: int | None = None, prefill_chunk: int | None = None, device: str = "auto",
                 max_model_len: int | None = None, backends=None, cuda_graphs: bool | str = True,
                 verify: bool = True, speculative: str = "off", num_draft_tokens: int = 3, draft: str | None = None,
                 speculative_auto: bool = True, compile_decode: bool = False, fused_replay: bool | None = None,
                 verify_ahead: bool = False):
    """Load a checkpoint, its tokenizer and chat template; returns (engine, tokenizer, chat_template). `backends`
    (k3.ops.registry.Backends) picks the ops' implementations, `cuda_graphs` is EngineConfig.cuda_graphs.
    `verify`: check the shards against the SHA-256 digests their index records. `speculative`, `num_draft_tokens`:
    EngineConfig's; `draft`: the EAGLE-3 draft's directory (default with speculative='eagle3': CK/draft);
    `speculative_auto`: EngineConfig.speculative_auto (on: speculation per batch size where it measures faster);
    `compile_decode`: EngineConfig.compile_decode; `fused_replay`: EngineConfig.fused_replay; `verify_ahead`:
    EngineConfig.verify_ahead."""
    from k3.data.tokenizer import load_any_tokenizer
    from k3.devices import pick_device
    from k3.serve.chat import load_chat_template
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.options import draft_dir
    from k3.serve.scheduler import SchedulerConfig

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    dev = pick_device(device)
    sched = SchedulerConfig(**{k: v for k, v in (("max_num_seqs", max_num_seqs), ("max_step_tokens", max_step_tokens),
                                                 ("prefill_chunk", prefill_chunk)) if v is not None})
    ecfg = EngineConfig(scheduler=sched, max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                        compile_decode=compile_decode, fused_replay=fused_replay, verify_ahead=verify_ahead,
                        speculative=speculative, num_draft_tokens=num_draft_tokens, speculative_auto=speculative_auto,
                        draft=draft_dir(ckpt_dir, speculative, draft),
                        **{k: v for k, v in (("cache_memory_mb", cache_memory_mb), ("page_tokens", page_tokens),
                                             ("hash_block_tokens", hash_block_tokens)) if v is not None})
    ecfg.validate()  # before the (possibly slow) load
    if verify_ahead and (speculative == "off" or fused_replay is False):
        raise ValueError("--verify-ahead launches the next verification with the accepted drafts replayed in it: it "
                         "needs --speculative mtp or eagle3 with the fused replay (not --no-fused-replay)")
    if fused_replay is True and speculative == "off":
        raise ValueError("--fused-replay fuses the replay of accepted drafts into the next verification: it needs "
                         "--speculative mtp or eagle3")
    tokenizer = load_any_tokenizer(ckpt_dir)
    template = load_chat_template(ckpt_dir)
    model = load_for_generation(ckpt_dir, dev, backends=backends, verify=verify)
    return LLMEngine(model, tokenizer, ecfg), tokenizer, template


def load_for_generation(ckpt_dir: str, device, backends=None, verify: bool = True):
    """The checkpoint's model as the serving engine runs it on `device`: in `inference_dtype` (a float32
    checkpoint in bfloat16 on CUDA, said once on stderr), with an MXFP4 checkpoint's routed experts packed in memory
    where their kernels run (k3.checkpoint.from_pretrained's packed_experts="auto"); its weights require no
    gradients (nothing generating trains them; the inference-only kernels then run in any grad mode)."""
    from k3.checkpoint import from_pretrained, load_config
    from k3.ops.registry import notice

    device = torch.device(device)
    stored = load_config(ckpt_dir).torch_dtype
    dtype = inference_dtype(stored, device)
    if dtype != stored:
        notice(f"the checkpoint's {str(stored).removeprefix('torch.')} weights run in "
               f"{str(dtype).removeprefix('torch.')} on {device.type} (the serving cache's and kernels' dtype there)")
    model = from_pretrained(ckpt_dir, dtype=dtype, device=device, backends=backends, verify=verify,
                            packed_experts="auto")
    return model.requires_grad_(False)


def inference_dtype(stored: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a checkpoint stored in `stored` is generated from on `device`: its own, except float32 on CUDA,
    which runs in bfloat16 there. The serving cache is bfloat16 on CUDA, and the GPU's decode path (grouped
    expert GEMMs, CUDA graphs) takes bfloat16; a float32 model there would run the reference expert loop,
    eagerly, many times slower. Training keeps float32 master weights (under bf16 autocast), so every trained
    checkpoint is float32."""
    return torch.bfloat16 if device.type == "cuda" and stored == torch.float32 else stored
