"""The fault-injection run under load: see `tests.chaos.run`.

In the suite (`test_chaos.py`): Dramatiq and FastStream on RabbitMQ, 10,000 messages
each. Alone, on any supported broker and at any size::

    python -m tests.chaos --adapter dramatiq --broker rabbitmq --messages 100000
"""
