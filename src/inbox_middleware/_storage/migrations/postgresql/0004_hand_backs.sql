-- Hand-backs: deliveries the inbox itself gave back to the broker (the database was
-- unreachable, another delivery held the claim past lock_timeout, the worker was shutting
-- down). They count against nothing, but a broker that counts deliveries (JetStream,
-- RabbitMQ quorum queues) or flags redeliveries counts them too: the redelivery limit
-- subtracts them, with the failures, to find the deliveries that ended without an outcome.
ALTER TABLE ${inbox_attempts} ADD COLUMN IF NOT EXISTS hand_backs integer NOT NULL DEFAULT 0;
