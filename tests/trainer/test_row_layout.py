"""The one row layout (`RowLayout`): the host's row indices and the devices' strided views name the same rows, for
every size; `packed` describes the kept rows of each mini-batch, dealt into its leading micro-batches."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.trainer.minibatches import RowLayout, group_order

SIZES = list(itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3)))  # (M, m, rows per micro-batch)


@pytest.mark.parametrize("mini, micro, per", SIZES)
def test_host_and_device_name_the_same_rows(mini, micro, per):
    b = mini * micro * per
    layout = RowLayout(mini, micro)
    rows = jnp.arange(b)
    stacked = layout.all_micro_batches(rows)  # (M m, B/(M m))
    for j in range(mini):
        host = layout.rows(b, j)
        device = layout.select(rows, j)
        np.testing.assert_array_equal(np.asarray(device), host)
        micros = layout.micro_batches(device)
        for k in range(micro):
            want = layout.rows(b, j, k)
            np.testing.assert_array_equal(np.asarray(micros[k]), want)
            np.testing.assert_array_equal(np.asarray(stacked[k * mini + j]), want)  # whole-batch number c
            np.testing.assert_array_equal(want, [(k + r * micro) * mini + j for r in range(per)])
    # every row in exactly one micro-batch; unstack inverts the whole-batch split, on the host and on the devices
    assert sorted(np.concatenate([layout.rows(b, j, k) for j in range(mini) for k in range(micro)])) == list(range(b))
    w = np.arange(3.0)[None, :, None] + 10 * np.asarray(stacked)[:, None, :]  # (M m, W, B/(M m)), value = 10 row + w
    for back in (layout.unstack(w, axis=2), np.asarray(layout.unstack(jnp.asarray(w), axis=2))):
        np.testing.assert_array_equal(back, 10 * np.arange(b)[:, None] + np.arange(3.0))
    assert layout.unstack(w, axis=2).dtype == np.float64  # the host's copy is not cast


@pytest.mark.parametrize("mini, micro, per", SIZES)
def test_packed_kept_rows_fill_leading_micro_batches(mini, micro, per):
    b = mini * micro * per
    layout = RowLayout(mini, micro)
    keep = np.random.default_rng(b).random(b) < 0.4
    order = layout.packed(keep)
    np.testing.assert_array_equal(order, np.asarray(layout.packed(jnp.asarray(keep), jnp)))  # host == device
    for j in range(mini):
        own = layout.rows(b, j)
        assert sorted(order[own]) == sorted(own)  # a mini-batch keeps its own rows
        kept = [keep[order[layout.rows(b, j, k)]] for k in range(micro)]
        flat = np.concatenate(kept)
        assert list(flat) == sorted(flat, reverse=True)  # kept rows first, micro-batch by micro-batch
        read = np.concatenate([order[layout.rows(b, j, k)] for k in range(micro)])  # as the step reads them
        assert [o for o in read if keep[o]] == [o for o in own if keep[o]]  # in their order


def test_process_rows_are_contiguous_shares():
    layout = RowLayout(2, 2)
    shares = [np.arange(16)[layout.process_rows(16, p, 4)] for p in range(4)]
    np.testing.assert_array_equal(np.concatenate(shares), np.arange(16))
    assert all(len(s) == 4 for s in shares)


def test_group_order_writes_groups_through_the_layout():
    group_ids = np.repeat(np.arange(4), 3)
    order = group_order(group_ids, 2, seed=0, step=0)
    layout = RowLayout(2)
    for j in range(2):
        assert len(np.unique(group_ids[order[layout.rows(12, j)]])) == 2
    with pytest.raises(ValueError, match="multiple of num_mini_batches x num_micro_batches = 6"):
        RowLayout(2, 3).rows(8, 0)
