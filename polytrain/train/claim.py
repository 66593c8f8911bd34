"""Claiming ``checkpoint.dir`` for a run (`claim`): rank 0, before the run's first save and before it trains.

The directory is probed as ``output`` is (one line, exit 2, before any training: not a failed save an epoch in).
It must hold no other run's checkpoints, which this run's saves would replace or prune: they are refused — the
refusal advises a resume only where this spec could resume them — or, with --overwrite-checkpoints, moved into
``superseded-<time>-<pid>/``; a fresh run then also moves aside what earlier runs left in ``output`` (the metrics
log, its CSV and TensorBoard events, the final model), so that its log holds its own records only — as it does,
into ``earlier-<time>-<pid>/``, where there is no other run's checkpoint to claim (`earlier_outputs_aside`, also
for a run that writes none). Last, the best
checkpoints' ranking is taken up (`polytrain.train.callbacks.BestCheckpoints.start`): on a resume, without the entries of
later steps, which a rollback abandons.
"""

from __future__ import annotations

from pathlib import Path

from polytrain.checkpoint import files as cf
from polytrain.checkpoint import store as ckpt
from polytrain.checkpoint.files import check_writable_dir
from polytrain.errors import TrainingFailure
from polytrain.observe.metrics import MetricsLog, Progress
from polytrain.spec.tables import TrainSpec
from polytrain.train.callbacks import BestCheckpoints


def claim(spec: TrainSpec, owner: ckpt.Owner, best: BestCheckpoints | None, *, overwrite: bool,
          resumed_at: int | None, log: MetricsLog, progress: Progress) -> None:
    """Rank 0: claim checkpoint.dir for ``owner``'s run, resumed from step ``resumed_at`` (None: a fresh run)."""
    check_writable_dir("checkpoint.dir", spec.checkpoint_dir)
    _set_aside_other_runs(spec, owner, overwrite, fresh=resumed_at is None, log=log, progress=progress)
    if best is None:
        return
    aside = best.start(owner, resumed_at)
    if best.abandoned:
        names = ", ".join(f"best/{e['path']}" for e in best.abandoned)
        progress.line(f"resumed at step {resumed_at}: the best checkpoints of later steps ({names}) leave the "
                      f"ranking" + (f" and moved into {aside}" if aside else ""))
        log.write("best_checkpoints_abandoned", step=resumed_at, moved=[e["path"] for e in best.abandoned],
                  into=str(aside) if aside else None)


def _set_aside_other_runs(spec: TrainSpec, owner: ckpt.Owner, overwrite: bool, *, fresh: bool, log: MetricsLog,
                          progress: Progress) -> None:
    root = spec.checkpoint_dir
    theirs = [*ckpt.foreign_checkpoints(root, owner), *ckpt.foreign_checkpoints(root / "best", owner)]
    if not theirs:
        if fresh:
            earlier_outputs_aside(spec, log, progress)
        return
    if not overwrite:
        raise ckpt.CheckpointError(_refusal(spec, theirs))
    index = root / "best" / "index.json"
    if any(p.parent.name == "best" for p in theirs) and index.is_file():
        theirs.append(index)  # their ranking goes with their best checkpoints
    for latest in (root / "latest", root / "best" / "latest"):
        if latest.is_file() and latest.parent / latest.read_text().strip() in theirs:
            theirs.append(latest)
    output = Path(spec.output)
    # a fresh run's log would append to theirs: the logs and final model earlier runs left go aside too
    left = _earlier_outputs(spec, log) if fresh else []
    together = output.resolve() == root.resolve()  # one folder for both when output is checkpoint.dir
    try:
        aside = ckpt.move_aside(root, theirs + (left if together else []), "superseded")
        left_aside = aside if together else ckpt.move_aside(output, left, "superseded")
    except OSError as exc:
        raise TrainingFailure(f"checkpoint.dir: cannot move the checkpoints of another run in {root} aside "
                              f"({exc.strerror or exc}); free space, or set another output or checkpoint.dir") from exc
    progress.line(f"--overwrite-checkpoints: the checkpoints of another run in {root} moved into {aside}")
    moved_out = [str(p.relative_to(output)) for p in left]
    if left:
        progress.line(f"--overwrite-checkpoints: what earlier runs left in {output} ({', '.join(moved_out)}) moved "
                      f"into {left_aside}")
    log.write("checkpoints_superseded", moved=[str(p.relative_to(root)) for p in theirs], into=str(aside),
              **({"outputs_moved": moved_out, "outputs_into": str(left_aside)} if left else {}))


def _refusal(spec: TrainSpec, theirs: list[Path]) -> str:
    """Why this run may not start over another run's checkpoints, and what to do: resume that run only where this
    spec can (the same model digest; ``--resume auto`` takes only checkpoint.dir's own, not best/)."""
    root = spec.checkpoint_dir
    names = ", ".join(str(p.relative_to(root)) for p in theirs[:3]) + (
        f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
    regular = [p for p in theirs if p.parent == root]
    try:
        named = root / (root / "latest").read_text().strip()
    except (OSError, ValueError):
        named = None
    newest = named if named in regular else (regular[-1] if regular else None)  # what --resume auto would take
    digest = spec.model_digest()

    def resumable(path: Path | None) -> bool:
        manifest = ckpt.read_manifest(path) if path is not None else None
        return manifest is not None and manifest.get("model_digest") == digest

    best = [p for p in theirs if p.parent != root and resumable(p)]
    if resumable(newest):
        advice = "resume that run with --resume auto, "
    elif best:
        advice = f"resume that run with --resume {best[-1]}, "
    else:
        manifest = ckpt.read_manifest(newest or theirs[-1]) or {}
        advice = (f"that run had another model, data or seed (model digest {manifest.get('model_digest')}, this "
                  f"spec's {digest}), so this spec cannot resume it: ")
    return (f"checkpoint.dir: {root} holds checkpoints of another run ({names}; written by "
            f"{ckpt.run_of(theirs[-1])}), which this run would replace or prune: {advice}set another output or "
            f"checkpoint.dir, or pass --overwrite-checkpoints to move them into {root}/superseded-…/ (nothing is "
            f"deleted)")


def _earlier_outputs(spec: TrainSpec, log: MetricsLog) -> list[Path]:
    """What earlier runs left in ``output`` that a fresh run would append to or replace: the metrics log, its CSV
    and TensorBoard events, the final model (none once this run's log has started). An empty file or a folder
    with no file in it holds nothing of a run and stays where it is (a ``tb`` link to another disk, made ready)."""
    output = Path(spec.output)
    return [] if log.started else [p for p in [*log.files(), output / cf.MODEL_JSON, output / cf.MODEL_FILE,
                                               output / cf.PENDING] if _holds_something(p)]


def _holds_something(path: Path) -> bool:
    if path.is_dir():
        return any(f.is_file() and f.stat().st_size for f in path.rglob("*"))
    return path.is_file() and path.stat().st_size > 0


def earlier_outputs_aside(spec: TrainSpec, log: MetricsLog, progress: Progress) -> None:
    """Rank 0, a fresh run that found no other run's checkpoints (or writes none): what earlier runs left in
    ``output`` moves into ``earlier-<time>-<pid>/`` there (nothing is deleted), so that this run's log holds its
    own records only — a second run into one folder never appends to the first's metrics."""
    left = _earlier_outputs(spec, log)
    if not left:
        return
    output = Path(spec.output)
    try:
        aside = ckpt.move_aside(output, left, "earlier")
    except OSError as exc:
        raise TrainingFailure(f"output: cannot move an earlier run's logs in {output} aside ({exc.strerror or exc}); "
                              f"free space, or set another output") from exc
    moved = [str(p.relative_to(output)) for p in left]
    progress.line(f"what an earlier run left in {output} ({', '.join(moved)}) moved into {aside}: this run's log "
                  f"starts empty")
    log.write("earlier_outputs_moved", moved=moved, into=str(aside))
