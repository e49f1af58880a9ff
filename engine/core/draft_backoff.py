"""Back-off for a stream whose drafts keep being rejected, so that a workload prompt lookup cannot
predict costs almost nothing: a rejected draft costs its tokens' compute and KV slots.

After MISSES verify steps in a row that accept nothing, the stream proposes no draft for its next
FIRST_PAUSE decode steps; then one draft probes, and if that too accepts nothing the pause doubles
(up to MAX_PAUSE steps). Any accepted draft token ends the back-off: the counts start over."""

from __future__ import annotations

MISSES = 3  # verify steps in a row with nothing accepted before the first pause
FIRST_PAUSE = 2  # decode steps without drafts after those misses
MAX_PAUSE = 64  # the longest pause: a stream whose text starts to repeat is drafted again within it


class DraftBackoff:
    """One stream's back-off state, kept by the scheduler."""

    def __init__(self):
        self.misses = 0  # verify steps in a row that accepted nothing
        self.pause = 0  # decode steps left without drafts
        self.next_pause = FIRST_PAUSE
        self.probing = False  # a pause ended: one more miss pauses again, twice as long

    def proposes(self) -> bool:
        """Whether this decode step may draft; a paused step counts down."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def record(self, num_accepted: int) -> None:
        """A verify step's outcome."""
        if num_accepted:
            self.misses, self.next_pause, self.probing = 0, FIRST_PAUSE, False
            return
        self.misses += 1
        if self.probing or self.misses >= MISSES:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)
            self.misses, self.probing = 0, True
