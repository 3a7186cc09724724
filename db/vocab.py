"""The words the store holds, defined once: run statuses, rank statuses, event kinds and metric names.

The trainer, the supervisor, the store, the CLI and every page use these names; grep finds one
definition of each. Plain strings (not Enum members): they travel through `marshal` in the relay
and into every database driver unchanged. Standard library only: every rank imports this.
"""

from __future__ import annotations


class RunStatus:
    """A run's status. Written in few places (docs/architecture.md lists them): the launcher (queued),
    the supervisor (running, and the outcome), stop (stopping, stopped), the queue (cancelled),
    reconciliation (lost), and rank 0 of a run without a supervisor."""

    QUEUED = "queued"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    CANCELLED = "cancelled"  # taken out of the queue before it started

    ACTIVE = (QUEUED, RUNNING, STOPPING)
    FINAL = (SUCCEEDED, FAILED, STOPPED, LOST, CANCELLED)
    ALL = (*ACTIVE, *FINAL)


class RankStatus:
    """One rank's status, written by the rank's own metric stream (and closed by the supervisor)."""

    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"  # trained every step
    STOPPED = "stopped"
    FAILED = "failed"

    ACTIVE = (STARTING, RUNNING)


class EventKind:
    """What a run's event says happened."""

    QUEUED = "queued"  # the run waits for the machine's capacity (trainer/queue.py)
    ADMITTED = "admitted"  # the queue gave it its devices or cores; its supervisor starts
    CANCELLED = "cancelled"  # taken out of the queue
    LAUNCHED = "launched"  # the supervisor started torchrun
    STARTED = "started"  # rank 0 is training
    RESTART = "restart"  # a restarted attempt resumes from the checkpoint
    DESYNC = "desync"  # replicas' parameters differ
    RANK_FAILED = "rank_failed"  # a rank raised (its traceback in the detail)
    FAILED = "failed"  # the run failed (the root cause in the detail)
    FINISHED = "finished"
    NODE_DONE = "node_done"  # a Slurm node's ranks finished; the run succeeds when every node's have
    EXIT_WARNING = "exit_warning"  # torchrun exited non-zero after every rank had finished
    STOP = "stop"  # a stop was requested
    STOPPED = "stopped"
    LOST = "lost"
    SUPERVISOR_LOST = "supervisor_lost"  # the supervisor died; the ranks went on without it
    DB_OUTAGE = "db_outage"  # the database was unreachable for a long while; metrics were held meanwhile
    STACKS = "stacks"  # every rank's stack, captured (trainer/stacks.py): the verdict, the stacks as JSON
    HUNG = "hung"  # a rank stopped stepping (trainer/health.py): its stacks' verdict, the Flight Recorder's finding
    STRAGGLER = "straggler"  # the rank the others wait for (trainer/health.py)
    NONFINITE = "nonfinite"  # a rank's first non-finite loss or gradient norm
    PROFILE = "profile"  # a rank's torch.profiler trace of N steps (trainer/profiling.py): its top operators as JSON
    ALERT_FAILED = "alert_failed"  # a webhook could not be delivered (trainer/alerts.py)

    PROBLEMS = (RANK_FAILED, FAILED, DESYNC, LOST, SUPERVISOR_LOST, DB_OUTAGE, HUNG, NONFINITE, ALERT_FAILED)


class Metric:
    """Names of the metrics the trainer logs per rank (a user's script may log any others)."""

    LOSS = "loss"
    SAMPLES_PER_S = "samples_per_s"
    TOKENS_PER_S = "tokens_per_s"
    STEP_TIME = "step_time"
    DATA_TIME = "data_time"
    LR = "lr"
    GRAD_NORM = "grad_norm"  # the total gradient norm, at log steps
    # Where a step's time goes (seconds per step, per log window; trainer/phases.py): the trainer's own
    # timers, and DDP's sampled backward timings (compute, communication, their overlap).
    FORWARD_TIME = "forward_time"
    BACKWARD_TIME = "backward_time"
    OPTIMIZER_TIME = "optimizer_time"
    COMM_TIME = "comm_time"  # the backward's all-reduce, from its first bucket's start to its last's end
    COMM_OVERLAP_TIME = "comm_overlap_time"  # the part of it that ran while backward still computed
    COMM_SHARE = "comm_share"  # comm_time over the whole step (data wait included): 0..1
    GPU_MEM_MB = "gpu_mem_mb"
    ACC = "acc"  # the built-in classification recipes' accuracy
    VAL_PREFIX = "val_"  # a recipe's metrics over the validation set, e.g. val_acc
    VAL_LOSS = VAL_PREFIX + LOSS
    VAL_ACC = VAL_PREFIX + ACC
    EPOCH = "epoch"

    PHASES = (DATA_TIME, FORWARD_TIME, BACKWARD_TIME, OPTIMIZER_TIME)  # a step, in order (backward holds the wait)
    LIVE = (LOSS, SAMPLES_PER_S, TOKENS_PER_S, STEP_TIME, DATA_TIME, VAL_LOSS, VAL_ACC, FORWARD_TIME, BACKWARD_TIME,
            OPTIMIZER_TIME, COMM_TIME, COMM_OVERLAP_TIME, COMM_SHARE)
