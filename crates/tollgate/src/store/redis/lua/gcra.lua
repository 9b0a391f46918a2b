-- GCRA (algorithm/gcra.rs): state = the exact theoretical arrival time (see
-- bucket_state), decided by bucket.lua, the tolerance as its capacity: a request
-- conforms only while the arrival time stays within the tolerance (past it, after a
-- charge that did not conform, not even a cost of 0 does).
ALG[5] = bucket_alg(false)

-- ALG[5] for a lone check (see ALONE in fixed_window.lua).
ALONE[5] = bucket_alone(false)

-- Takes back a charge: the instant moves back by cost x window / limit (bucket.lua).
REFUND[5] = bucket_refund

-- A charge that did not fit (`charge_rejected`): bucket.lua.
CHARGE[5] = bucket_charge
