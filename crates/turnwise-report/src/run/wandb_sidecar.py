"""turnwise's Weights & Biases sidecar (embedded in the binary by crates/turnwise-report/src/run/wandb.rs).

Protocol, one JSON object per line. turnwise writes to stdin: first the run's settings
{"mode": "online"|"offline", "project", "entity", "name", "group", "job_type", "dir", "config"},
then one line per metrics line, {"step": n, "phase": "train", "values": {tag: number}}; it closes
stdin at the end of the run (or when it dies). The sidecar answers on stdout:
{"event": "ready", "mode", "reason", "url", "dir"} once wandb.init returned (mode "offline" with
a reason when "online" was asked without an API key), {"event": "error", "message"} instead when
it cannot start, and {"event": "finished", ...} after wandb.finish(). Everything else (wandb's own
messages) goes to stderr.
"""

import json
import netrc
import os
import signal
import sys
import urllib.parse

# The protocol keeps the real stdout; anything else printed there goes to stderr.
PROTO = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
# Ctrl-C reaches the whole process group: finish when turnwise closes stdin, not before.
signal.signal(signal.SIGINT, signal.SIG_IGN)


def send(**fields):
    PROTO.write(json.dumps(fields) + "\n")
    PROTO.flush()


def logged_in():
    """Whether W&B has credentials: $WANDB_API_KEY, or `wandb login`'s netrc entry."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    host = urllib.parse.urlparse(url).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def run_dir(run):
    """The run's own folder (wandb's `run.dir` is its `files/` subfolder)."""
    d = getattr(run, "dir", None)
    if d and os.path.basename(os.path.normpath(d)) == "files":
        d = os.path.dirname(os.path.normpath(d))
    return d


def main():
    settings = json.loads(sys.stdin.readline() or "{}")
    try:
        import wandb
    except ImportError as e:
        send(event="error", message=f"cannot import wandb: {e}")
        return 2
    mode, reason = settings.get("mode", "offline"), None
    if mode == "online" and not logged_in():
        mode = "offline"
        reason = "no WANDB_API_KEY and no `wandb login` credentials were found"
    keys = ("project", "entity", "name", "group", "job_type", "dir", "config")
    kwargs = {k: settings[k] for k in keys if settings.get(k) is not None}
    try:
        run = wandb.init(mode=mode, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to turnwise, which stops the run
        send(event="error", message=f"wandb.init failed: {type(e).__name__}: {e}")
        return 1
    send(event="ready", mode=mode, reason=reason, url=getattr(run, "url", None), dir=run_dir(run))
    axes, tags = set(), set()
    for line in sys.stdin:
        if not line.strip():
            continue
        record = json.loads(line)
        # Each phase has its own x axis (`step/train`, `step/sft`, ...): warm-start steps and
        # RL steps count separately, and wandb's own step only ever grows.
        axis = "step/" + record["phase"]
        if axis not in axes:
            run.define_metric(axis)
            axes.add(axis)
        for tag in record["values"]:
            if tag not in tags:
                run.define_metric(tag, step_metric=axis)
                tags.add(tag)
        run.log({**record["values"], axis: record["step"]})
    run.finish()
    send(event="finished", mode=mode, url=getattr(run, "url", None), dir=run_dir(run))
    return 0


sys.exit(main())
