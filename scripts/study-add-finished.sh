#!/usr/bin/env bash
# Stages the finished runs of a study directory for a commit, so that a study that takes longer
# than one machine's lease survives it: `turnwise study run` skips a run whose summary.json is
# there, so a later checkout resumes with the runs not yet finished. Checkpoints and the arms'
# copies of the warm-start model stay out (.gitignore); warm/<name>/warm-start-model, which the
# arms start from, goes in.
#
#   scripts/study-add-finished.sh studies/paper-claims && git commit -m "..."
set -euo pipefail
dir=${1:?usage: scripts/study-add-finished.sh STUDY_DIR}
cd "$(git rev-parse --show-toplevel)"
[ -f "$dir/study.toml" ] || { echo "$dir is not a study directory (no study.toml)" >&2; exit 2; }
git add "$dir/study.toml" "$dir/panel.json" "$dir/.turnwise-study"
n=0
for run in "$dir"/warm/* "$dir"/runs/*/*; do
  [ -d "$run" ] || continue
  if [ -f "$run/summary.json" ] && python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$run/summary.json" 2>/dev/null; then
    git add "$run"
    case "$run" in
      */warm/*) log="$dir/logs/warm-$(basename "$run").log" ;;
      *) log="$dir/logs/$(basename "$(dirname "$run")")-$(basename "$run").log" ;;
    esac
    [ -f "$log" ] && git add "$log"
    n=$((n + 1))
  fi
done
echo "staged $n finished runs of $dir"
