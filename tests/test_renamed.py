"""The old keyword names of the vocabulary's renames still work for 0.1, with a warning."""

import warnings

import pytest

from tensortier._renamed import renamed


@renamed(to="tier", capacity="budget")
def place(x, *, tier="host", budget=None):
    return x, tier, budget


def test_the_new_names_pass_through_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert place(1, tier="disk", budget=5) == (1, "disk", 5)


def test_an_old_name_maps_to_the_new_one_with_a_warning_naming_it():
    with pytest.warns(DeprecationWarning, match=r"to= is now tier="):
        assert place(1, to="disk") == (1, "disk", None)


def test_both_names_at_once_is_refused():
    with pytest.raises(TypeError, match=r"both to= and tier="):
        place(1, to="disk", tier="host")


def test_an_unknown_keyword_stays_a_type_error():
    with pytest.raises(TypeError):
        place(1, shelf="disk")
