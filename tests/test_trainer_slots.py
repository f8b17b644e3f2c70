"""update.slot_variables: the slots the fused update ops write are the ones Keras' own update writes.

The mapping reads Keras' private slot lists, so it is held to Keras' public behaviour: one
`apply_gradients` of keras.optimizers.Adam / SGD(momentum) with known gradients, and each returned
slot must then hold that variable's m, v or momentum as Keras' formulas give them by hand.
Fails for: m and v swapped, a slot of another variable (an index off by one), a momentum slot for
plain SGD, or a slot list that misses one of the optimizer's slot variables.
"""

import keras
import numpy as np
import pytest

from seg_train.train.update import slot_variables

SHAPES = [(3, 2), (4,), (2, 2, 2)]


def setup(optimizer):
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.normal(size=s).astype("float32"), name=f"v{i}") for i, s in enumerate(SHAPES)]
    grads = [rng.normal(size=s).astype("float32") * (i + 1) for i, s in enumerate(SHAPES)]
    optimizer.build(variables)
    optimizer.apply_gradients(zip(grads, variables))
    return variables, grads, slot_variables(optimizer, variables)


def test_adam_slots_are_each_variables_m_and_v():
    opt = keras.optimizers.Adam(learning_rate=0.1)
    variables, grads, slots = setup(opt)
    for g, (m, v) in zip(grads, slots):
        np.testing.assert_allclose(np.asarray(m), (1 - opt.beta_1) * g, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(v), (1 - opt.beta_2) * g * g, rtol=1e-4)
    # Every slot Keras keeps (its variables bar the scalar counters) is returned, each once.
    returned = [id(x) for pair in slots for x in pair]
    assert sorted(returned) == sorted(id(x) for x in opt.variables if len(x.shape))


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_sgd_slots(momentum):
    opt = keras.optimizers.SGD(learning_rate=0.1, momentum=momentum)
    variables, grads, slots = setup(opt)
    if not momentum:
        assert slots == [[] for _ in SHAPES]
        return
    for g, (accum,) in zip(grads, slots):
        np.testing.assert_allclose(np.asarray(accum), -0.1 * g, rtol=1e-6)  # Keras: m = momentum * m - lr * g
    assert sorted(id(a) for (a,) in slots) == sorted(id(x) for x in opt.variables if len(x.shape))
