"""Writing through your own Session or repository inside the inbox's transaction."""

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from inbox_middleware.dramatiq import current_session

# Your application's own factory, as you already have it.
AppSession = sessionmaker()


class AccountRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def credit(self, account_id: int, amount: int) -> None:
        self.session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :id"),
            {"amount": amount, "id": account_id},
        )
        self.session.commit()  # your code may commit: see below


def add_credit(account_id: int, amount: int) -> None:  # the body of an inbox actor
    # Bind your session to the inbox transaction's connection. "create_savepoint" makes
    # its commit() release a savepoint instead of committing, and its rollback() undo
    # only its own work: the inbox still commits everything, claim included, at the end.
    with AppSession(
        bind=current_session().connection(), join_transaction_mode="create_savepoint"
    ) as session:
        AccountRepository(session).credit(account_id, amount)
