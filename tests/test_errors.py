import pickle

import pytest

from tensortier import errors


@pytest.mark.parametrize(
    "err",
    [
        errors.ConfigError("bad"),
        errors.BudgetError("b", budget=1, minimum=2),
        errors.TierFullError("full", tier="shm", requested=3, in_use=4, limit=5),
        errors.SpillDirError("gone", path="/x"),
        errors.CorruptDataError("crc", path="/y"),
        errors.ClosedError("closed"),
        errors.NodeLostError("gone", node="ab12"),
        errors.RecordTypeError("record 3 cannot be stored", record=3, field="meta"),
    ],
)
def test_errors_survive_pickling_with_their_attributes(err):
    # Ray pickles an actor's exception to raise it in the caller (tt.rl.serve)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.args == err.args
    assert vars(back) == vars(err)
