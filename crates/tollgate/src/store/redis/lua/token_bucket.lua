-- Token bucket (algorithm/token_bucket.rs): state = the exact instant the bucket is
-- full again (see bucket_state), decided by bucket.lua. A debt (past the capacity: a
-- charge the bucket could not hold) counts in full, except that it leaves the bucket
-- empty: a cost of 0 still fits.
ALG[4] = bucket_alg(true)

-- ALG[4] for a lone check (no lockout, not already rejected), state read and written
-- here (see ALONE in fixed_window.lua).
ALONE[4] = bucket_alone(true)

-- Takes back a charge: the instant moves back by cost x window / limit (bucket.lua).
REFUND[4] = bucket_refund

-- A charge that did not fit (`charge_rejected`): bucket.lua.
CHARGE[4] = bucket_charge
