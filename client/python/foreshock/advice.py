"""Advice from foreshockd to the trainer (docs/alerting.md "Advice to the
trainer"; client/python/README.md "Advice").

When an alert of the run fires (and when an advised one resolves), the
daemon sends an advice to every rank: checkpoint now, or checkpoint and
stop. libforeshock's I/O thread keeps what arrives; Monitor.step() takes it
on the training thread, so a handler may touch the model, the optimizer and
the data loader right there:

    rescue = foreshock.Rescue(lambda adv: save_checkpoint(adv.trainer_step))
    mon = foreshock.Monitor(model, run="exp-1", on_advice=rescue)
    for step in ...:
        ...
        mon.step(step, loss=loss)
        if rescue.stop:
            break

Without on_advice, Monitor.advice lists what arrived and was not handled
(the caller may act on it and clear the list).
"""
import logging

log = logging.getLogger("foreshock")

CHECKPOINT = "checkpoint"
CHECKPOINT_AND_STOP = "checkpoint_and_stop"
RESOLVED = "resolved"
SUPERSEDED = "superseded"


class Advice:
    """One advice. action: "checkpoint", "checkpoint_and_stop", "resolved"
    (an advised alert resolved) or "superseded" (ended by a rewind).
    alert_id names /api/v1/alerts/{alert_id}; rule, label (the attribution,
    e.g. "attention-numerics") and severity describe it; step is the
    firing (or resolving) step, first_breach_step and fired_step the
    incident's, rollback_step the last step before the evidence began (a
    checkpoint at or before it predates the fault's evidence; None when
    unknown); layer, head, window, rank its scope (None: not applicable).
    trainer_step is the step() call that delivered it."""

    __slots__ = ("advice_id", "action", "alert_id", "rule", "label", "severity", "step",
                 "first_breach_step", "fired_step", "rollback_step", "layer", "head", "window",
                 "rank", "trainer_step")

    def __init__(self, trainer_step=None, **fields):
        for k in self.__slots__:
            setattr(self, k, fields.get(k))
        self.trainer_step = trainer_step

    @property
    def checkpoint(self):
        """True when the advice asks for a checkpoint (with or without a stop)."""
        return self.action in (CHECKPOINT, CHECKPOINT_AND_STOP)

    @property
    def stop(self):
        return self.action == CHECKPOINT_AND_STOP

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self):
        return (f"Advice({self.action} alert={self.alert_id} rule={self.rule} "
                f"label={self.label} step={self.step} rollback_step={self.rollback_step})")


class AdviceInbox:
    """What Monitor.step() does with advice, on the training thread: takes
    what the transport received and hands each to on_advice, or keeps it in
    `pending` when there is no handler. A handler's exception propagates out
    of step(): the trainer asked to act on advice and could not."""

    def __init__(self, transport, on_advice=None):
        self.transport = transport
        self.on_advice = on_advice
        self.pending = []
        self.received = 0
        self._poll = getattr(transport, "poll_advice", None)

    def poll(self, trainer_step, on_fail=None):
        """Hands over what arrived. Reading the transport never raises:
        a failure goes to on_fail("advice", None, exc) (the Monitor's
        counter) and the advice of this call is skipped; the handler's own
        exception propagates."""
        if self._poll is None:
            return
        try:
            got = [Advice(trainer_step=trainer_step, **fields) for fields in self._poll()]
        except Exception as e:
            if on_fail is None:
                raise
            on_fail("advice", None, e)
            return
        for adv in got:
            self.received += 1
            log.log(logging.WARNING if adv.checkpoint else logging.INFO,
                    "foreshock: advice at step %s: %s", trainer_step, adv)
            if self.on_advice is None:
                self.pending.append(adv)
            else:
                self.on_advice(adv)


class Rescue:
    """The common on_advice handler: saves a checkpoint through the
    trainer's own save(advice) when advised (at most once per step(), however
    many alerts advised at once), and sets `stop` when told to stop (after
    the save). `checkpoints` lists the advices that caused a save, and
    `advice` every advice handled."""

    def __init__(self, save):
        if not callable(save):
            raise TypeError("Rescue(save): save must be callable, save(advice)")
        self.save = save
        self.stop = False
        self.stop_advice = None
        self.checkpoints = []
        self.advice = []
        self._saved_step = object()

    def __call__(self, advice):
        self.advice.append(advice)
        if advice.checkpoint and advice.trainer_step != self._saved_step:
            self.save(advice)
            self._saved_step = advice.trainer_step
            self.checkpoints.append(advice)
        if advice.stop and not self.stop:
            self.stop = True
            self.stop_advice = advice
            log.warning("foreshock: told to stop at step %s (%s)", advice.trainer_step, advice)
