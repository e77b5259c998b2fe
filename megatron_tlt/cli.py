"""The training entry point's command line and ``main``: GRPO on megatron-core with TLT
rollouts. ``pretrain_rl_tlt.py`` (the repository's launcher) and the GPU check call
``run`` / ``parse`` / ``main`` here, so the package never runs the repository's files.

    torchrun --nproc_per_node 2 pretrain_rl_tlt.py --config examples/rl/smollm2_cpu.yaml
    torchrun --nproc_per_node 8 pretrain_rl_tlt.py --config examples/rl/qwen2.5_7b_grpo.yaml \\
        --tensor-model-parallel-size 2 --lr 1e-6 --wandb-project my-rl
    python pretrain_rl_tlt.py --config examples/rl/qwen2.5_32b_grpo.yaml --dry-run --world-size 64

Configuration: defaults, then each --config recipe, then section.field=value overrides
(--help-config lists every field). Megatron-LM's common flags are accepted as aliases
of config fields (see MEGATRON_FLAGS); an alias and an override of the same field
conflict only if they disagree.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .assets import AssetError
from .checkpoint import CheckpointError
from .config import ConfigError, build_parser, config_from_args
from .fileio import write_text_atomic
from .models.drafter import DrafterMismatchError
from .models.gpt import UnsupportedModelError
from .rl.data import DataError
from .rl.nonfinite import NonFiniteError

DESCRIPTION = "GRPO training of a reasoning LLM on megatron-core, with TLT rollouts."

# Megatron-LM flag -> config field
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size": "parallel.tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "parallel.pipeline_model_parallel_size",
    "--expert-model-parallel-size": "parallel.expert_model_parallel_size",
    "--moe-aux-loss-coeff": "train.moe_aux_loss_coef",
    "--micro-batch-size": "train.micro_batch_size",
    "--global-batch-size": "train.global_batch_size",
    "--lr": "train.lr",
    "--min-lr": "train.min_lr",
    "--lr-warmup-iters": "train.lr_warmup_steps",
    "--lr-decay-style": "train.lr_decay",
    "--clip-grad": "train.clip_grad",
    "--weight-decay": "train.weight_decay",
    "--train-iters": "train.steps",
    "--seed": "platform.seed",
    "--save": "checkpoint.save",
    "--load": "checkpoint.load",
    "--save-interval": "checkpoint.save_interval",
    "--wandb-project": "tracking.wandb_project",
    "--wandb-exp-name": "tracking.run_name",
    "--grpo-group-size": "grpo.group_size",
    "--grpo-prompts-per-step": "grpo.prompts_per_step",
    "--grpo-clamp-eps-lower": "grpo.clip_eps_low",
    "--grpo-clamp-eps-upper": "grpo.clip_eps_high",
    "--grpo-kl-beta": "grpo.kl_beta",
    "--grpo-iterations": "grpo.ppo_epochs",
    "--hf-path": "model.hf_path",
}


def build_rl_parser():
    parser = build_parser(DESCRIPTION)
    for flag, key in MEGATRON_FLAGS.items():
        parser.add_argument(flag, dest="alias:" + key, default=None, metavar="V",
                            help=f"alias of {key}")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the recipe against --world-size, print the parallel "
                             "layout and a memory estimate, load no weights")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--dry-run: the world size to check (default: WORLD_SIZE or 1)")
    return parser


def parse(argv=None):
    args = build_rl_parser().parse_args(argv)
    overrides = []
    for dest, value in vars(args).items():
        if dest.startswith("alias:") and value is not None:
            overrides.append(f"{dest[len('alias:'):]}={value}")
    args.overrides = overrides + list(args.overrides)  # explicit overrides win
    return args, config_from_args(args)


def speculation(engine) -> str:
    """The run's drafters, as its first log line names them."""
    if not engine.drafters:
        return "off"
    return "on (" + ", ".join(d.label for d in engine.drafters.values()) + ")"


def main(argv=None) -> int:
    args, cfg = parse(argv)
    if args.dry_run:
        from .rl.plan import dry_run

        world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        print(dry_run(cfg, world))
        return 0
    from .runtime_env import silence_expected_warnings

    silence_expected_warnings()
    from .heartbeat import Heartbeat, rendezvous_store
    from .launch import setup, shutdown
    from .rl import run_dir
    from .rl.preemption import Stopped, StopRequest
    from .rl.report import print_summary, write_plots
    from .rl.reproducibility import contract
    from .rl.trainer import Trainer, config_dict
    from .tracking import Tracker

    # Every check comes before the first write: the run folder (read only), then the
    # model and tokenizer (setup), the data, verifier and drafter (Trainer), the
    # checkpoint (resume). Only then is the run folder opened (rl/run_dir.py).
    t0 = time.perf_counter()
    run_name = cfg.tracking.run_name or time.strftime("%Y%m%d-%H%M%S")
    resume_from = cfg.checkpoint.load
    requested = run_dir.choose(cfg.tracking, run_name, resume=bool(resume_from))
    session = setup(cfg)
    rank = session.platform.rank
    heartbeat = Heartbeat.from_environment(cfg.parallel.heartbeat_timeout_s)
    if heartbeat is not None:
        heartbeat.start()
    # SIGTERM / SIGUSR1 / {checkpoint.save}/STOP, shared through the rendezvous store:
    # the step in progress is abandoned (or finished), checkpoint, exit 75
    stop = StopRequest(cfg.checkpoint.save, cfg.checkpoint.stop_deadline_s,
                       store=rendezvous_store("megatron_tlt/stop",
                                              cfg.parallel.collective_timeout_s)).install()
    trainer = Trainer(cfg, session, stop=stop)
    resumed = trainer.resume(resume_from) if resume_from else None

    opened = run_dir.open_run(cfg.tracking, run_name,
                              resumed_step=trainer.state.step if resumed else None,
                              config=config_dict(cfg)) if rank == 0 else None
    folder = opened.path if opened is not None else requested
    tracker = Tracker(cfg.tracking, folder, rank=rank, config_dict=config_dict(cfg))
    if opened is not None:
        tracker.info(opened.describe(Path(cfg.tracking.output_dir).expanduser() / run_name))
    if resumed:
        tracker.info(f"resumed from {resumed} at step {trainer.state.step}")
        if trainer.state.step >= cfg.train.steps:
            tracker.info(f"warning: the checkpoint is at step {trainer.state.step} and "
                         f"train.steps={cfg.train.steps}: no step left to run; raise "
                         f"train.steps (--train-iters) to continue training")
    lay = session.layout
    tracker.info(f"GRPO on {session.source.name} ({session.arch.num_parameters / 1e6:.0f}M "
                 f"params): world {session.platform.world_size} = TP {lay.tp_size} x PP "
                 f"{lay.pp_size} x DP {lay.dp_size}, {session.platform.device.type}/"
                 f"{session.platform.backend}; {cfg.grpo.prompts_per_step} prompts x "
                 f"{cfg.grpo.group_size} samples per step, {cfg.train.steps} steps; "
                 f"speculative decoding {speculation(trainer.engine)}")
    tracker.info(contract(cfg)[1])  # bit-exact, or exact in distribution only
    try:
        history = trainer.train(tracker)
    except Stopped as stopped:
        if rank == 0:
            tracker.info(str(stopped) + f"; exit code {stopped.exit_code}"
                         + (" (requeue: resume with checkpoint.load="
                            f"{cfg.checkpoint.save})" if stopped.checkpoint else ""))
        if heartbeat is not None:
            heartbeat.stop()
        shutdown()
        return stopped.exit_code
    stop.uninstall()
    exported = None
    if cfg.checkpoint.export_hf:
        from .checkpoint.export import export_trained

        exported = export_trained(trainer.policy.module, trainer.state.drafter, lay,
                                  session.arch, session.source,
                                  Path(cfg.checkpoint.save or folder) / "hf",
                                  step=trainer.state.step)
    if rank == 0:
        plots = write_plots(tracker.metrics_path, folder) if cfg.tracking.plots else []
        print_summary(history, run_dir=folder, metrics=tracker.metrics_path,
                      wandb_dir=tracker.wandb_dir, plots=plots,
                      seconds=time.perf_counter() - t0, exported=exported)
        write_text_atomic(folder / "summary.json", json.dumps(
            {"steps": trainer.state.step, "seconds": time.perf_counter() - t0}, indent=1))
    if heartbeat is not None:
        heartbeat.stop()
    shutdown()
    return 0


# the errors a user's input causes: one line and exit code 2, no traceback
INPUT_ERRORS = (ConfigError, FileNotFoundError, AssetError, UnsupportedModelError,
                CheckpointError, DataError, DrafterMismatchError)


def run(argv=None) -> int:
    """``main`` with bad input reported as ``error: <message>`` (exit code 2) and
    non-finite values past ``train.max_nonfinite_steps`` as exit code 1."""
    try:
        return main(argv)
    except INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # bad values mid-run (see train.max_nonfinite_steps)
        print(f"error: {e}", file=sys.stderr)
        return 1
