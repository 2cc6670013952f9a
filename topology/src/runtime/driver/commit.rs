//! Commits: forwarding held results, changelog and progress records, offsets
//! (a transaction per task under exactly-once, one group commit under
//! at-least-once), then the local state.

use super::*;

impl Engine {
    /// True when a task's producer was fenced by a newer one with its
    /// transactional id: whatever error its commit reported (a purged
    /// delivery, a failed flush), another instance owns the task now.
    fn producer_fenced(&self, id: TaskId) -> bool {
        use rdkafka::error::RDKafkaErrorCode as C;
        self.tasks.get(&id).is_some_and(|t| {
            t.producer.client().fatal_error().is_some_and(|(code, _)| {
                matches!(
                    code,
                    C::Fenced | C::ProducerFenced | C::InvalidProducerEpoch
                )
            })
        })
    }

    /// Commits every task.
    pub(super) fn commit_all(&mut self, consumer: &DriverConsumer) -> Result<(), RuntimeError> {
        let started = Instant::now();
        let ids: Vec<TaskId> = self.tasks.keys().copied().collect();
        self.commit_tasks(consumer, &ids)?;
        self.metrics
            .commit_seconds
            .observe(started.elapsed().as_secs_f64());
        // The interval runs from the end of a commit, so slow commits still
        // leave a full interval of processing between them.
        self.last_commit = Instant::now();
        Ok(())
    }

    /// Commits some tasks. Under exactly-once their transactions commit in
    /// parallel (each task has its own producer).
    pub(super) fn commit_tasks(
        &mut self,
        consumer: &DriverConsumer,
        ids: &[TaskId],
    ) -> Result<(), RuntimeError> {
        self.flush_tasks(ids)?;
        if !self.eos() {
            return self.commit_alos(consumer, ids);
        }
        let meta = consumer
            .group_metadata()
            .ok_or_else(|| RuntimeError::Other("no consumer group metadata".into()))?;
        let app = self.cfg.application_id.clone();
        let metrics = self.metrics.clone();
        let tasks: Vec<&mut ActiveTask> = self
            .tasks
            .values_mut()
            .filter(|t| ids.contains(&t.core.id))
            .collect();
        let order: Vec<TaskId> = tasks.iter().map(|t| t.core.id).collect();
        let results: Vec<Result<(), RuntimeError>> =
            if tasks.len() <= 1 || !self.cfg.parallel_commits {
                tasks
                    .into_iter()
                    .map(|t| commit_eos(t, &meta, &app, &metrics))
                    .collect()
            } else {
                std::thread::scope(|s| {
                    let handles: Vec<_> = tasks
                        .into_iter()
                        .map(|t| {
                            let (meta, app, metrics) = (&meta, &app, &metrics);
                            s.spawn(move || commit_eos(t, meta, app, metrics))
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| {
                            h.join().unwrap_or_else(|_| {
                                Err(RuntimeError::Other("commit thread panicked".into()))
                            })
                        })
                        .collect()
                })
            };
        let mut migrated = Vec::new();
        for (id, result) in order.into_iter().zip(results) {
            match result {
                Ok(()) => {}
                Err(e) if e.task_migrated() || self.producer_fenced(id) => {
                    tracing::warn!(task = %id, error = %e, "task fenced or its transaction must abort: closing it dirty and rejoining");
                    migrated.push(id);
                }
                Err(e) => return Err(e),
            }
        }
        if !migrated.is_empty() {
            let mut paused = TopicPartitionList::new();
            for id in &migrated {
                if let Some(t) = self.tasks.get(id) {
                    for (topic, partition) in &t.partitions {
                        paused.add_partition(topic, *partition);
                    }
                }
            }
            self.close_dirty(&migrated);
            // Nothing is read for them until the group says who owns them.
            if let Err(e) = consumer.pause(&paused) {
                tracing::debug!(error = %e, "pausing a closed task's partitions failed");
            }
            self.rejoin = true;
        }
        Ok(())
    }

    pub(super) fn commit_alos(
        &mut self,
        consumer: &DriverConsumer,
        ids: &[TaskId],
    ) -> Result<(), RuntimeError> {
        let Some((producer, delivery)) = self.shared_producer.clone() else {
            return Ok(());
        };
        let app = self.cfg.application_id.clone();
        let threads = self.cfg.processing_threads;
        flush(&producer, &delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
        let work: Vec<(TaskId, Vec<(usize, i64)>)> =
            in_parallel(self.tasks_mut(ids), threads, |task| {
                let prepared = task.core.prepare_commit(false);
                send_changelog(task, &app, prepared.changelog)?;
                Ok((task.core.id, prepared.offsets))
            })?;
        flush(&producer, &delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
        failpoint("alos_after_changelog_flush");
        // Progress records go last, once the state they describe is in the
        // changelogs: a progress record read back implies its state was
        // written (without transactions nothing else orders them).
        let progress: Vec<bool> = in_parallel(self.tasks_mut(ids), threads, |task| {
            let rec = task.core.write_progress(false);
            let some = rec.is_some();
            send_changelog(task, &app, rec.into_iter().collect())?;
            Ok(some)
        })?;
        if progress.contains(&true) {
            flush(&producer, &delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
        }
        failpoint("alos_before_offset_commit");
        let offsets_of: HashMap<TaskId, &[(usize, i64)]> =
            work.iter().map(|(id, o)| (*id, o.as_slice())).collect();
        in_parallel(self.tasks_mut(ids), threads, |task| {
            let next = delivery.take_changelog_next(task.core.id);
            let offsets = offsets_of.get(&task.core.id).copied().unwrap_or_default();
            task.core.finish_commit(offsets, &next)?;
            let ends = delivery.take_output_next(task.core.id);
            task.core.ctx.output_ends.extend(ends);
            Ok(())
        })?;
        let mut tpl = TopicPartitionList::new();
        for (id, offsets) in &work {
            let task = self
                .tasks
                .get(id)
                .or_else(|| self.suspended.get(id))
                .expect("task listed above");
            for (slot, offset) in offsets {
                let s = &task.core.slots[*slot];
                tpl.add_partition_offset(&s.topic, s.partition, Offset::Offset(*offset))?;
            }
        }
        if tpl.count() > 0 {
            if let Err(e) = consumer.commit(&tpl, CommitMode::Sync) {
                let e = RuntimeError::from(e);
                if !e.task_migrated() {
                    return Err(e);
                }
                // The group moved on without this member: its tasks' state is
                // in the changelogs already; their offsets are another
                // owner's to commit.
                tracing::warn!(error = %e, "offset commit refused: closing the tasks and rejoining");
                let ids: Vec<TaskId> = work.iter().map(|(id, _)| *id).collect();
                self.close_dirty(&ids);
                self.rejoin = true;
                return Ok(());
            }
        }
        self.metrics.commits.inc();
        Ok(())
    }
}

/// Commits one task's transaction: outputs sent, offsets sent to the
/// transaction, outputs flushed, changelog records sent and flushed, commit;
/// then local state.
pub(super) fn commit_eos(
    task: &mut ActiveTask,
    meta: &rdkafka::consumer::ConsumerGroupMetadata,
    app: &str,
    metrics: &EngineMetrics,
) -> Result<(), RuntimeError> {
    let id = task.core.id;
    let PreparedCommit {
        changelog: dirty,
        offsets,
    } = task.core.prepare_commit(true);
    let outputs = task.core.take_output();
    if offsets.is_empty() && dirty.is_empty() && outputs.is_empty() && !task.txn_open {
        return Ok(());
    }
    if !task.txn_open {
        task.producer.begin_transaction()?;
        task.txn_open = true;
    }
    let t0 = Instant::now();
    produce_outputs(task, metrics, outputs)?;
    // The offsets join the transaction while the outputs are on their way
    // (they commit with it, or not at all).
    if !offsets.is_empty() {
        let tpl = offsets_tpl(&task.core, &offsets)?;
        task.producer
            .send_offsets_to_transaction(&tpl, meta, TXN_TIMEOUT)?;
    }
    // Outputs first: a changelog record visible to a reader implies the
    // outputs that preceded it are visible too.
    flush(&task.producer, &task.delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
    let t1 = Instant::now();
    failpoint("eos_after_output_flush");
    send_changelog(task, app, dirty)?;
    // The commit's own flush (see `kafka::commit_transaction`), with the
    // tests' crash point between it and the commit.
    flush(&task.producer, &task.delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
    failpoint("eos_after_changelog_flush");
    let t2 = Instant::now();
    task.producer.commit_transaction(TXN_TIMEOUT)?;
    tracing::trace!(
        task = %id,
        outputs_ms = (t1 - t0).as_millis() as u64,
        changelog_ms = (t2 - t1).as_millis() as u64,
        end_ms = t2.elapsed().as_millis() as u64,
        "transaction committed"
    );
    task.txn_open = false;
    failpoint("eos_after_commit_before_local");
    let next = task.delivery.take_changelog_next(id);
    task.core.finish_commit(&offsets, &next)?;
    task.core
        .ctx
        .output_ends
        .extend(task.delivery.take_output_next(id));
    metrics.commits.inc();
    Ok(())
}

pub(super) fn offsets_tpl(
    core: &TaskCore,
    offsets: &[(usize, i64)],
) -> Result<TopicPartitionList, RuntimeError> {
    let mut tpl = TopicPartitionList::new();
    for (slot, offset) in offsets {
        let s = &core.slots[*slot];
        tpl.add_partition_offset(&s.topic, s.partition, Offset::Offset(*offset))?;
    }
    Ok(tpl)
}

pub(super) fn send_changelog(
    task: &mut ActiveTask,
    app: &str,
    dirty: Vec<sluice_state::ChangelogRecord>,
) -> Result<(), RuntimeError> {
    if dirty.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = task
        .core
        .ctx
        .state
        .as_ref()
        .map(|s| {
            s.specs()
                .map(|s| Topology::changelog_topic(app, &s.name))
                .collect()
        })
        .unwrap_or_default();
    let id = task.core.id;
    let no_headers = Vec::new();
    for rec in dirty {
        send(
            &task.producer,
            &names[rec.store.0],
            Some(id.partition),
            Some(&rec.key),
            rec.value.as_deref(),
            None,
            &no_headers,
            DeliveryTag::Changelog {
                task: id,
                store: rec.store.0,
            },
        )?;
    }
    Ok(())
}

pub(super) fn send_outputs(
    task: &mut ActiveTask,
    metrics: &EngineMetrics,
    eos: bool,
) -> Result<(), RuntimeError> {
    flush_counters(task, metrics);
    if eos {
        // Held until the commit: a task's transaction is open only while it
        // commits, so an instance's transactions never overlap (some brokers
        // delay a commit while an overlapping transaction is open), and a crash
        // between commits leaves no transaction behind.
        if task.core.ctx.out.len() >= MAX_HELD_OUTPUTS {
            task.core.ctx.commit_requested = true;
        }
        return Ok(());
    }
    let out = task.core.take_output();
    produce_outputs(task, metrics, out)
}

pub(super) fn produce_outputs(
    task: &mut ActiveTask,
    metrics: &EngineMetrics,
    out: Vec<OutputRecord>,
) -> Result<(), RuntimeError> {
    for r in &out {
        send(
            &task.producer,
            &r.topic,
            r.partition,
            r.key.as_deref(),
            r.value.as_deref(),
            Some(r.timestamp),
            &r.headers,
            DeliveryTag::Output(task.core.id),
        )?;
    }
    metrics.records_out.inc_by(out.len() as u64);
    Ok(())
}

pub(super) fn flush_counters(task: &mut ActiveTask, metrics: &EngineMetrics) {
    let c = &mut task.core.ctx.counters;
    if c.late_dropped > 0 {
        metrics.late.inc_by(std::mem::take(&mut c.late_dropped));
    }
    if c.replay_skipped > 0 {
        metrics
            .replay_skipped
            .inc_by(std::mem::take(&mut c.replay_skipped));
    }
    for (cat, n) in c.dead_lettered.drain() {
        metrics.dlq.with_label_values(&[&cat]).inc_by(n);
    }
}

/// Outputs queued by a task beyond which it asks for an early commit
/// (exactly-once holds outputs until the commit).
pub(super) const MAX_HELD_OUTPUTS: usize = 50_000;
