"""Saving made deterministic for tests that read the checkpoints a run leaves."""

from megatron_lorafusion.train.saving import Saver


def every_checkpoint_written(monkeypatch) -> None:
    """An export waits for its adapter's queued checkpoints instead of superseding them (a
    busy writer would otherwise leave fewer checkpoints than the test needs)."""
    real_submit = Saver.submit

    def submit(self, request):
        if request.export_step is not None:
            self.writer.drain()
        real_submit(self, request)

    monkeypatch.setattr(Saver, "submit", submit)
