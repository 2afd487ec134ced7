"""The read side of a study: `StudyView.open(storage, study)` opens a stored study read-only (never creating a
storage, its tables or a study) and answers what `report`, `export`, `status` and `reproduce` ask of it: the
standings (one standing trial per plan), the front, the best measured plan, the calibration and its typed
history, the counts and the status. Every read goes through the retrying storage of `open_storage` (an outage
is waited out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stratagem.errors import StratagemError
from stratagem.evaluators.calibration import Calibration
from stratagem.search.calibrate import CalibrationStep, calibration_history
from stratagem.search.counts import StudyCounts, study_counts
from stratagem.search.noise import BestMeasured, best_measured
from stratagem.search.records import Standing, StudyKey, front_trials, standings
from stratagem.search.storage import StorageSpec, load_study, open_storage, parse_storage, study_names

if TYPE_CHECKING:
    import optuna

    from stratagem.search.status import StudyStatus

__all__ = ["StudyView"]


@dataclass(frozen=True)
class StudyView:
    """A stored study, opened read-only (module docstring)."""

    spec: StorageSpec
    storage: optuna.storages.BaseStorage
    study: optuna.Study

    @classmethod
    def open(cls, storage: str, study: str | None = None) -> StudyView:
        """Open `study` in the storage at URL `storage` read-only; with no name, the storage's only study. One
        line naming the studies there when the name is missing or wrong; nothing is created."""
        spec = parse_storage(storage)
        backend = open_storage(spec, write=False)
        names = study_names(backend)
        if study is None:
            if len(names) != 1:
                listing = ", ".join(names) if names else "none"
                raise StratagemError(f"--study: {spec.url} holds {len(names)} studies ({listing}); name one "
                                     "with --study")
            study = names[0]
        if study not in names:
            listing = ", ".join(names) if names else "none"
            raise StratagemError(f"--study ({study!r}): no such study in {spec.url}; studies there: {listing}")
        return cls(spec=spec, storage=backend, study=load_study(backend, study, spec.url))

    @property
    def name(self) -> str:
        """The study's name."""
        return self.study.study_name

    def attrs(self) -> dict[str, Any]:
        """The study's user attributes (read now)."""
        return self.study.user_attrs

    def trials(self) -> list[optuna.trial.FrozenTrial]:
        """Every trial (read now, not copied: do not modify)."""
        return self.study.get_trials(deepcopy=False)

    def standings(self) -> dict[str, Standing]:
        """Plan key -> the trial that stands for the plan (`records.standings`)."""
        return standings(self.trials())

    def front(self) -> list[optuna.trial.FrozenTrial]:
        """The Pareto front's standing trials, highest tokens/s first (`records.front_trials`)."""
        return front_trials(self.study)

    def best_measured(self) -> BestMeasured | None:
        """The best measured plan by the one rule (`noise.best_measured`: pooled re-measures, its noise)."""
        return best_measured(self.study)

    def calibration(self) -> Calibration | None:
        """The calibration the study's real runs refitted; None before any run."""
        fitted = self.attrs().get(StudyKey.CALIBRATION)
        return Calibration.model_validate(fitted) if fitted else None

    def calibration_history(self) -> list[CalibrationStep]:
        """One typed entry per refit (`calibrate.calibration_history`)."""
        return calibration_history(self.attrs().get(StudyKey.CALIBRATION_HISTORY))

    def counts(self) -> StudyCounts:
        """The study's counts by the one counting rule (`search.counts.study_counts`)."""
        return study_counts(self.study)

    def status(self, now: float | None = None) -> StudyStatus:
        """What the study holds now, for the person on call (`search.status.study_status`)."""
        from stratagem.search.status import study_status

        return study_status(self.study, now)
