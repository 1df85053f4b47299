# A stand-in for the `wandb` package, for the tests of the W&B sidecar
# (crates/turnwise-report/src/run/wandb.rs and crates/turnwise/tests/tracking.rs): records every
# call as a JSON line in $FAKE_WANDB_LOG;
# $FAKE_WANDB_DIE_AFTER=N exits the process at the N+1-th `log`, and $FAKE_WANDB_HANG=1 makes
# `log` never return.
import json, os, time
_out = open(os.environ["FAKE_WANDB_LOG"], "a")
def _record(call, **kw):
    _out.write(json.dumps({"call": call, **kw}) + "\n")
    _out.flush()
class _Run:
    def __init__(self, kw):
        self.dir = os.path.join(kw.get("dir", "."), "wandb", "offline-run-fake", "files")
        self.url = "https://wandb.invalid/fake" if kw["mode"] == "online" else None
        self.logged = 0
    def define_metric(self, name, step_metric=None):
        _record("define_metric", name=name, step_metric=step_metric)
    def log(self, data):
        self.logged += 1
        if self.logged > int(os.environ.get("FAKE_WANDB_DIE_AFTER") or 10**9):
            os._exit(3)
        if os.environ.get("FAKE_WANDB_HANG"):
            time.sleep(3600)
        _record("log", data=data)
    def finish(self):
        _record("finish")
def init(**kw):
    _record("init", **kw)
    return _Run(kw)
