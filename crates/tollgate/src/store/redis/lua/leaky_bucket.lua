-- Leaky bucket, meter and queue (algorithm/leaky_bucket.rs): state = the exact
-- instant the bucket is empty (see bucket_state), decided by bucket.lua, the level as
-- how far that instant is ahead of now. In queue mode (the check's queue flag) an
-- admitted request waits for the level ahead of it to drain.
ALG[6] = bucket_alg(false)

-- ALG[6] for a lone check (see ALONE in fixed_window.lua).
ALONE[6] = bucket_alone(false, true)

-- Takes back a charge: the instant moves back by cost x window / limit (bucket.lua).
REFUND[6] = bucket_refund

-- A charge that did not fit (`charge_rejected`): bucket.lua.
CHARGE[6] = bucket_charge
