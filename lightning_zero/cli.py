"""Command line: ``lightning-zero <command> [args]`` (also ``python -m lightning_zero``).

The command name is looked up in :data:`COMMANDS` before any parsing, and the handler gets the
rest of argv untouched, so a command may parse its own arguments: ``train`` hands them to Hydra,
which must not see argparse. To add a command, add ``name: Command(handler, summary)``; a
handler takes the arguments after the name and returns the exit code.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from lightning_zero.estimator import (
    OFFLOADS,
    PRECISIONS,
    PRESETS,
    EstimateOptions,
    estimate_memory,
    parse_count,
    parse_size,
)
from lightning_zero.estimator.advisor import advise
from lightning_zero.estimator.working_set import StreamSettings


@dataclass(frozen=True)
class Command:
    """One subcommand: ``handler(argv_after_name) -> exit code`` and a one-line summary."""

    handler: Callable[[list[str]], int]
    summary: str


def _typed(parse: Callable[[str], float]) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    return convert


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in two lines (the error, and where the options are) instead of the whole
    usage (17 lines for ``advise``) above it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def _size(text: str) -> float:
    return parse_size(text, unit_required=True)


def _common_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("model (give --params or --model)")
    what.add_argument("--params", type=_typed(parse_count), help="trainable parameters Ψ, e.g. 7.5e9, 7.5B, 350M")
    what.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or 'module.path:ClassOrFactory', "
                      "built with no arguments on the meta device and counted")
    what.add_argument("--largest-layer", type=_typed(parse_count),
                      help="parameters of the largest single module (stage 3 gathers it whole)")
    what.add_argument("--precision", default="mixed", choices=list(PRECISIONS),
                      help="fp32; mixed = bf16-mixed / 16-mixed (16-bit params + fp32 master); bf16-true")
    what.add_argument("--optimizer-bytes", type=int, default=8,
                      help="fp32 bytes of optimizer state per parameter (Adam/AdamW: 8, SGD+momentum: 4)")
    what.add_argument("--replicated-params", type=_typed(parse_count),
                      help="parameters tensor parallelism keeps whole on every rank (norms, row-parallel biases, "
                      "position embeddings; default: counted from --model's plan, else 0)")
    ranks = p.add_argument_group("layout (world size = nodes x GPUs per node = data x tensor-parallel ranks)")
    ranks.add_argument("--world-size", type=int, help="ranks N (data-parallel ranks x --tensor-parallel)")
    ranks.add_argument("--num-nodes", type=int, help="nodes (CPU memory and NVMe are per node)")
    ranks.add_argument("--gpus-per-node", type=int,
                       help="ranks per node (default: 8 when N is a multiple of 8, else N on one node)")
    shape = p.add_argument_group("activations (all of micro-batch, seq-len, layers, hidden; presets fill the shape)")
    shape.add_argument("--micro-batch", type=int, help="samples per rank per forward")
    shape.add_argument("--seq-len", type=int, help="tokens per sample")
    shape.add_argument("--layers", type=int, help="transformer layers")
    shape.add_argument("--hidden", type=int, help="hidden size")
    shape.add_argument("--heads", type=int, help="attention heads (default hidden / 64)")
    shape.add_argument("--flash-attention", action="store_true", help="attention scores are not stored")
    p.add_argument("--units", default="GB", choices=["GB", "GiB"], help="GB = 10^9 bytes (default), GiB = 2^30")
    host = p.add_argument_group("ranks on CPUs, and stage 3's working set (docs/offload.md)")
    host.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"],
                      help="cpu: the ranks are CPU processes and device memory is their host memory (the process "
                      "itself, cpu offload and stage 3's working set counted in it)")
    host.add_argument("--prefetch-bucket-size", type=_typed(parse_count), default=5e7,
                      help="zero.prefetch_bucket_size: elements gathered ahead of the running unit (default 5e7)")
    host.add_argument("--reduce-bucket-size", type=_typed(parse_count), default=1e7,
                      help="zero.reduce_bucket_size: elements per gradient message (default 1e7)")
    host.add_argument("--sub-group-size", type=_typed(parse_count), default=1e6,
                      help="offload.sub_group_size: optimizer elements swapped at once with nvme (default 1e6)")


def _model_kwargs(a: argparse.Namespace) -> EstimateOptions:
    return EstimateOptions(
        model=a.model, world_size=a.world_size, num_nodes=a.num_nodes, gpus_per_node=a.gpus_per_node,
        precision=a.precision, micro_batch=a.micro_batch, seq_len=a.seq_len, layers=a.layers, hidden=a.hidden,
        heads=a.heads, flash_attention=a.flash_attention, largest_layer_params=a.largest_layer,
        optimizer_state_per_param=a.optimizer_bytes, replicated_params=a.replicated_params,
        accelerator=a.accelerator,
        stream=StreamSettings(prefetch_bucket_size=a.prefetch_bucket_size, reduce_bucket_size=a.reduce_bucket_size,
                              sub_group_size=a.sub_group_size, state_tensors=a.optimizer_bytes // 4),
    )


def _run(name: str, description: str, build: Callable[[argparse.ArgumentParser], None],
         act: Callable[[argparse.Namespace], int], argv: list[str]) -> int:
    parser = _Parser(prog=f"lightning-zero {name}", description=description)
    build(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help or a usage error: argparse has printed why
        return int(done.code or 0)
    try:
        return act(args)
    except ValueError as err:
        print(f"lightning-zero {name}: error: {err}", file=sys.stderr)
        return 2


def estimate_command(argv: list[str]) -> int:
    """``lightning-zero estimate``: per-rank memory of stages 0-3 with and without offload."""

    def build(p: argparse.ArgumentParser) -> None:
        _common_arguments(p)
        p.add_argument("--offload", default="all", choices=["all", *OFFLOADS],
                       help="offload rows to show besides no offload (default: every valid option)")
        p.add_argument("--tensor-parallel", type=int, default=1,
                       help="ranks per tensor-parallel group (default 1: none); ZeRO partitions over the rest")
        p.add_argument("--expert-parallel", type=int, default=1,
                       help="ranks per expert-parallel group of a MoE model (default 1: none): each holds "
                       "1/N of the experts")

    def act(a: argparse.Namespace) -> int:
        est = estimate_memory(a.params, offload=a.offload, tensor_parallel=a.tensor_parallel,
                              expert_parallel=a.expert_parallel, **_model_kwargs(a))
        print(est.table(a.units))
        return 0

    return _run("estimate", estimate_command.__doc__ or "", build, act, argv)


def advise_command(argv: list[str]) -> int:
    """``lightning-zero advise``: the fastest ZeRO configuration that fits (exit code 1 if none does)."""

    def build(p: argparse.ArgumentParser) -> None:
        hw = p.add_argument_group("hardware (sizes with their unit, like 80GB, 80GiB, 512G, 2TB; GB = 10^9 bytes, "
                                  "GiB = 2^30)")
        hw.add_argument("--device-memory", type=_typed(_size), required=True, help="accelerator memory per rank")
        hw.add_argument("--cpu-memory", type=_typed(_size), default=0.0, help="host memory per node")
        hw.add_argument("--nvme", type=_typed(_size), default=0.0, help="NVMe capacity per node")
        hw.add_argument("--nvme-path", default=tempfile.gettempdir(),
                        help="directory for the swap files of an NVMe choice, named in its overrides and checked "
                        "for writability and free space (default: the system's temporary directory, "
                        f"{tempfile.gettempdir()})")
        hw.add_argument("--headroom", type=float, default=0.1,
                        help="fraction of each memory kept free for buffers, fragmentation, etc. (default 0.1)")
        hw.add_argument("--activation-checkpointing", action="store_true",
                        help="fit checkpointed activations instead of full ones")
        _common_arguments(p)
        p.add_argument("--tensor-parallel", type=int, default=None,
                       help="ranks per tensor-parallel group to advise for (default: none, and the smallest size "
                       "that fits when nothing fits without it)")
        p.add_argument("--expert-parallel", type=int, default=1,
                       help="ranks per expert-parallel group of a MoE model to advise for (default 1: none)")

    def act(a: argparse.Namespace) -> int:
        result = advise(a.params, device_memory=a.device_memory, cpu_memory=a.cpu_memory, nvme=a.nvme,
                        headroom=a.headroom, activation_checkpointing=a.activation_checkpointing,
                        nvme_path=a.nvme_path, tensor_parallel=a.tensor_parallel,
                        expert_parallel=a.expert_parallel, **_model_kwargs(a))
        print(result.table(a.units))
        problem = result.nvme_path_problem()
        if problem:  # the suggested command would be refused: say so, and how to fix it
            print(f"lightning-zero advise: error: {problem}", file=sys.stderr)
        return 0 if result.choice is not None and not problem else 1

    return _run("advise", advise_command.__doc__ or "", build, act, argv)


def train_command(argv: list[str]) -> int:
    """``lightning-zero train``: compose ``conf/`` with Hydra (``-m`` sweeps too) and train each run.

    Hydra and Lightning are imported here, not at module level, so ``estimate`` / ``advise`` stay fast.
    """
    from lightning_zero.config.run.launch import train_command as run

    return run(argv)


def _export_hf_run(checkpoint: str, out: str, shard_bytes: int) -> str:
    """``convert --hf``: the run directory's ``config.yaml`` (above ``checkpoints/``) says where the model came from."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from lightning_zero.config.schema import HFCausalLMSchema, to_train_config
    from lightning_zero.hf.export import export_pretrained

    found = next((d / "config.yaml" for d in Path(checkpoint).resolve().parents if (d / "config.yaml").is_file()), None)
    if found is None:
        raise ValueError(f"no config.yaml of a run above {checkpoint}: --hf converts a checkpoint of a "
                         "`lightning-zero train model=hf_causal_lm` run (<run dir>/checkpoints/last.ckpt).")
    model = to_train_config(OmegaConf.to_container(OmegaConf.load(found))).model  # type: ignore[arg-type]
    if not isinstance(model, HFCausalLMSchema):
        raise ValueError(f"{found} is not a model=hf_causal_lm run (model: {getattr(model, 'kind', model)}); --hf "
                         "writes transformers directories. Fix: convert to a .safetensors file instead.")
    return str(export_pretrained(checkpoint, out, source=model.path, config=model.config, tokenizer=model.tokenizer,
                                 max_shard_bytes=shard_bytes))


def _evaluation(command: str) -> Callable[[list[str]], int]:
    def handler(argv: list[str]) -> int:
        from lightning_zero.config.run.launch import train_command as run

        return run(argv, command)

    return handler


def convert_command(argv: list[str]) -> int:
    """``lightning-zero convert``: a sharded checkpoint directory (or a consolidated ``.ckpt``) -> one file (no
    process group)."""

    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("checkpoint", help="a sharded checkpoint directory (or its name, e.g. last.ckpt), or a "
                       "consolidated Lightning .ckpt file (its state_dict)")
        p.add_argument("out", help="output file: *.safetensors (safetensors), anything else: torch.save; with --hf a "
                       "directory")
        p.add_argument("--lightning", action="store_true",
                       help="write a normal Lightning .ckpt (weights, optimizer, loops, hyper-parameters) "
                       "that LightningModule.load_from_checkpoint opens")
        p.add_argument("--hf", action="store_true",
                       help="a model=hf_causal_lm run's checkpoint -> a directory AutoModelForCausalLM.from_pretrained "
                       "loads (safetensors shards and index, the run's config.json and tokenizer)")
        p.add_argument("--shard-size", type=_typed(parse_size), default=2 * 1024**3,
                       help="with --hf: the largest safetensors file, e.g. 500MB (default 2GiB)")
        p.add_argument("--prefix", default="", help="keep only keys under this prefix, without it (e.g. 'model.')")

    def act(a: argparse.Namespace) -> int:
        from lightning_zero.checkpoint import CheckpointError, convert_checkpoint

        try:
            if a.hf:
                print(f"wrote {_export_hf_run(a.checkpoint, a.out, int(a.shard_size))}")
                return 0
            out = convert_checkpoint(a.checkpoint, a.out, lightning=a.lightning, prefix=a.prefix)
        except (CheckpointError, ValueError, NotImplementedError) as err:
            print(f"lightning-zero convert: {err}", file=sys.stderr)
            return 1
        print(f"wrote {out}")
        return 0

    return _run("convert", convert_command.__doc__ or "", build, act, argv)


def hostfile_command(argv: list[str]) -> int:
    """``lightning-zero hostfile``: a DeepSpeed-style hostfile -> the ``lightning-zero train`` command of each
    host (torchrun's rendezvous replaces ssh / pdsh: see README "Several nodes"); ``--ssh`` runs them."""

    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("hostfile", help="lines 'HOST slots=N' (N = processes on that host); the first host is node 0")
        p.add_argument("overrides", nargs="*", help="train overrides shared by every node, e.g. experiment=gpt_small")
        p.add_argument("--port", type=int, default=29500, help="rendezvous port on the first host (default 29500)")
        p.add_argument("--ssh", action="store_true", help="run each host's command over ssh instead of printing it")
        p.add_argument("--workdir", default=".", help="with --ssh: the directory to run in on every host")

    def act(a: argparse.Namespace) -> int:
        from pathlib import Path

        from lightning_zero.config.multinode import host_commands, parse_hostfile, run_over_ssh

        try:
            text = Path(a.hostfile).read_text()
        except OSError as err:
            raise ValueError(f"cannot read the hostfile: {err}") from err
        commands = host_commands(parse_hostfile(text), a.overrides, a.port)
        if a.ssh:
            return run_over_ssh(commands, Path(a.workdir).resolve())
        for host, command in commands:
            print(f"# on {host}\n{command}")
        return 0

    return _run("hostfile", hostfile_command.__doc__ or "", build, act, argv)


COMMANDS: dict[str, Command] = {
    "estimate": Command(estimate_command, "per-rank memory of ZeRO stages 0-3, with and without offload"),
    "advise": Command(advise_command, "the fastest ZeRO stage / offload that fits your hardware"),
    # Hydra parses its own argv: main() hands it over untouched
    "train": Command(train_command, "train from Hydra configs in conf/ (e.g. experiment=gpt_small zero=stage2)"),
    "validate": Command(_evaluation("validate"), "the validation loop of train's groups on ckpt_path=<a checkpoint or "
                        "a run directory>"),
    "test": Command(_evaluation("test"), "the test loop, the same way (your DataModule's test_dataloader)"),
    "predict": Command(_evaluation("predict"), "predict_step over the data, the same way; each rank's predictions "
                       "to <run dir>/predictions/"),
    "convert": Command(convert_command, "a sharded checkpoint -> one .pt / .safetensors / Lightning .ckpt"),
    "hostfile": Command(hostfile_command, "a DeepSpeed hostfile -> the train command to run on each host (or --ssh)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: lightning-zero <command> [args]   (lightning-zero <command> --help for its options)", "",
             "commands:"]
    lines += [f"  {name.ljust(width)}  {c.summary}" for name, c in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-zero``; returns the exit code.

    Args:
        argv: arguments after the program name (default ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"lightning-zero: unknown command {args[0]!r}.\n{_usage()}", file=sys.stderr)
        return 2
    return command.handler(args[1:])


if __name__ == "__main__":
    sys.exit(main())
