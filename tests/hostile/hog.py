"""Source text for a child process whose same-host reader is a hog: it counts itself in flight on
every slot of each lease table it is served, as it is built, and never leaves."""

#: Defines ``HogReader`` (a ``OneSidedPeer`` that enters every slot of its table when it is
#: built); ``samehost_link.OneSidedPeer = HogReader`` makes every reader of the process one.
HOG_READER = r"""
from kvdd.sim.fabric import samehost_path as _hog_path
class HogReader(_hog_path.OneSidedPeer):
    def __init__(self, link):
        super().__init__(link)
        for slot in range(self.table.slots):
            self.table.enter(slot)
"""
