//! The commit protocol in one place: the order in which a commit's parts
//! (see [`crate::task::CommitParts`]) reach the broker under each guarantee,
//! in Kafka Streams' words prepare → commit (offsets, or the transaction) →
//! post-commit. The runtime's at-least-once and exactly-once commits and the
//! test driver implement [`CommitPath`]: how each part gets there.

use std::ops::ControlFlow;

use crate::guarantee::Guarantee;

/// A point between two steps of a commit, where the tests crash or hang an
/// instance (the runtime's failpoints) or the test driver stops a commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CommitPoint {
    /// At-least-once: the changelog records are acknowledged; the progress
    /// records and the offsets are not sent.
    ChangelogFlushed,
    /// At-least-once: the progress records are acknowledged; the offsets
    /// are not committed.
    ProgressFlushed,
    /// Exactly-once: records and offsets are in the transactions, not yet
    /// flushed.
    OffsetsSent,
    /// Exactly-once: the transactions' records are acknowledged; the
    /// transactions are not committed.
    TransactionFlushed,
    /// Exactly-once: the transactions are committed; the local state is not
    /// written.
    TransactionCommitted,
}

/// How the parts of a commit of some tasks reach the broker. [`conduct`]
/// calls the steps in the protocol's order; each step covers every task of
/// the commit before the next step begins. Steps a guarantee does not take
/// do nothing unless a path implements them.
pub(crate) trait CommitPath {
    /// How a step fails.
    type Error;

    /// Prepare: takes each task's commit parts
    /// ([`crate::task::TaskCore::prepare_commit`]).
    fn prepare(&mut self, guarantee: Guarantee) -> Result<(), Self::Error>;

    /// Sends each task's changelog records (exactly-once: with its held
    /// outputs, in its transaction).
    fn send_changelog(&mut self) -> Result<(), Self::Error>;

    /// Waits until every record sent is acknowledged.
    fn flush(&mut self) -> Result<(), Self::Error>;

    /// At-least-once: sends each task's progress record; returns whether
    /// any was sent.
    fn send_progress(&mut self) -> Result<bool, Self::Error> {
        Ok(false)
    }

    /// At-least-once: commits the offsets to the consumer group.
    fn commit_offsets(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Exactly-once: adds each task's offsets to its transaction.
    fn send_offsets(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Exactly-once: commits each task's transaction.
    fn commit_transaction(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Post-commit: each task writes its state to its local store and notes
    /// its offsets committed ([`crate::task::TaskCore::post_commit`]).
    fn post_commit(&mut self) -> Result<(), Self::Error>;

    /// The commit reached `point`: go on, or end the commit there.
    fn reached(&mut self, point: CommitPoint) -> ControlFlow<()>;
}

/// Runs a commit along `path` under `guarantee`.
pub(crate) fn conduct<P: CommitPath>(path: &mut P, guarantee: Guarantee) -> Result<(), P::Error> {
    match guarantee {
        Guarantee::AtLeastOnce => {
            // Outputs, sent as they were made, are acknowledged first.
            path.flush()?;
            path.prepare(guarantee)?;
            path.send_changelog()?;
            path.flush()?;
            if path.reached(CommitPoint::ChangelogFlushed).is_break() {
                return Ok(());
            }
            // Progress records go last, once the state they describe is in
            // the changelogs: a progress record read back implies its state
            // was written (without transactions nothing else orders them).
            if path.send_progress()? {
                path.flush()?;
            }
            if path.reached(CommitPoint::ProgressFlushed).is_break() {
                return Ok(());
            }
            // The changelogs hold the state: it is written locally, then the
            // offsets are committed.
            path.post_commit()?;
            path.commit_offsets()
        }
        Guarantee::ExactlyOnce => {
            path.prepare(guarantee)?;
            path.send_changelog()?;
            // The offsets join the transactions while their records are on
            // their way (round trips to the coordinators that overlap their
            // delivery).
            path.send_offsets()?;
            if path.reached(CommitPoint::OffsetsSent).is_break() {
                return Ok(());
            }
            path.flush()?;
            if path.reached(CommitPoint::TransactionFlushed).is_break() {
                return Ok(());
            }
            path.commit_transaction()?;
            if path.reached(CommitPoint::TransactionCommitted).is_break() {
                return Ok(());
            }
            path.post_commit()
        }
    }
}
