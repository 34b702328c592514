"""Applications the tests run: the domain they change and Dramatiq apps."""
