"""What a worker's setup would refuse, checked on the driver before Ray starts, where no forward
is needed: the model as the workers build it, on the meta device (no weights).

    check_qlora(cfg, config)              # preflight.check_model_and_tokenizer: before check_adapters,
    check_setup(cfg, config, adapted)     # and after it, on its adapted meta model

A worker reaches these 30 to 50 s into a run (Ray, the worker group, the model built); here they
fail in seconds, on one line, before Ray starts. What still needs a forward stays in the
workers' setup (raypack/train/loop.py setup_worker), each before any step:

- the chunked loss's probe (loss.probe): the model's own logits against head(hidden) on a probe
  batch; values, so no meta model can answer;
- selective checkpointing's in-place hazard (checkpointing.check_selective): storage identities
  during a forward;
- train.compile's check (kernels.check_compiled): Dynamo's graph breaks, on the workers' device;
- the router probe (RouterLoss.probe): that every router scores every token in a real forward
  (a kernel such as Liger's fused MoE, applied on CUDA only, may replace them), and the trait
  search for a remote-code model that declares no router;
- an MLP that returns more than its hidden states under model.tiled_mlp_tokens (kernels._tiled):
  seen only in its output;
- sequence parallelism's probe (sequence.probe_split): one forward split over the real group;
- Liger's refusal of a family's RoPE (kernels.apply_kernels): Liger imports on CUDA only;
- DPO's reference pass and a resume's checkpoint (what they read exists on the workers).

A transformers model forward does not run on the meta device (`.item()` in the masks and the
MoE dispatch), so none of these can move without a copy of the model in memory.
"""

from __future__ import annotations

from typing import Any

from raypack.config import Config


def check_setup(cfg: Config, config: Any, adapted: Any = None) -> None:
    """Refuse what the workers' setup would refuse without a forward: model.tiled_mlp_tokens on
    layers without an MLP raypack can tile, and the router loss of an MoE model whose declared
    routers are missing, adapted below their scores, or without a top-k.
    `adapted`: the meta model with the run's adapters (preflight.check_adapters), if any."""
    from raypack.model.build import meta_model
    from raypack.model.routers import declared
    from raypack.train.objectives.router_loss import check_router_setting

    tiles = cfg.model.tiled_mlp_tokens
    routed = check_router_setting(cfg.train, config, cfg.model.name) > 0
    if not (tiles or routed):
        return
    model = adapted if adapted is not None else meta_model(config, cfg.model.trust_remote_code)
    if routed and declared(model) is not None:  # found by trait: only the workers' probe forward finds it
        from raypack.train.objectives.router_loss import make_router_loss

        router = make_router_loss(model, cfg.train, cfg.model.name)
        if router is not None:
            router.routers.remove()
    if tiles:
        from raypack.model.kernels import tile_mlps

        tile_mlps(model, tiles)  # on the meta model: which layers have an MLP to tile


def check_qlora(cfg: Config, config: Any) -> None:
    """QLoRA quantizes a checkpoint's weights as they load, for a causal LM (build.load_model)."""
    if cfg.model.peft.method != "qlora":
        return
    from raypack.model.adapters import AdapterError
    from raypack.model.build import from_checkpoint
    from raypack.model.facts import describe

    if describe(config, cfg.model.trust_remote_code).vlm:
        raise AdapterError(f"model.peft.method=qlora: model.name {cfg.model.name!r} is a vision-language model, and "
                           "QLoRA on one is not supported yet; use model.peft.method: lora")
    if not from_checkpoint(cfg.model.name):
        raise AdapterError(f"model.peft.method=qlora: model.name {cfg.model.name!r} is built from a config, with no "
                           "checkpoint whose weights QLoRA could quantize; use model.peft.method: lora, or a checkpoint")
