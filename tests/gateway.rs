//! The HTTP task gateway against the broker: `sluice gateway` instances in
//! front of `sluice run` and the simulated provider. Tasks are submitted
//! over HTTP, their statuses read and their results received over
//! server-sent events, on any instance.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::gateway::*;
use common::pipeline::*;
use common::{eventually, temp_dir};
use rdkafka::Message;
use serde_json::{json, Value};
use sluice::sim::SimConfig;

const TYPES: [&str; 3] = ["summarize", "classify", "extract"];

/// A submission's tenant number, task id, answer and event stream (status,
/// events, keep-alive comments).
type Outcome = (usize, String, Answer, (u16, Vec<Sse>, usize));

/// Waits until each gateway holds one of the two partitions.
fn wait_for_one_task_each(p: &Pipeline, gws: &[&Gateway]) {
    let c = client();
    eventually(Duration::from_secs(120), "one task on each gateway", || {
        p.rt.block_on(async {
            for g in gws {
                let a = get(&c, g.url("/readyz"), None).await;
                if a.status != 200 || a.json()["tasks"].as_array().is_none_or(|t| t.len() != 1) {
                    return None;
                }
            }
            Some(())
        })
    });
}

/// The results on the results topics, as JSON, by task id (each read).
fn results_by_id(p: &Pipeline, n: usize) -> HashMap<String, Vec<Value>> {
    let mut out: HashMap<String, Vec<Value>> = HashMap::new();
    for (r, m) in p.results(n, Duration::from_secs(180)) {
        out.entry(r.task_id)
            .or_default()
            .push(serde_json::from_slice(m.payload().unwrap()).unwrap());
    }
    out
}

/// Task records on the task topics with this id.
fn task_records(p: &Pipeline, task_id: &str) -> usize {
    let topics: Vec<String> = TYPES.iter().map(|t| p.topic(t)).collect();
    let mut n = 0;
    sluice::kafka::read_existing(
        &p.cluster,
        &topics,
        sluice::kafka::Start::Beginning,
        true,
        |m| {
            let v: Value =
                serde_json::from_slice(m.payload().unwrap_or_default()).unwrap_or_default();
            if v["taskId"] == task_id {
                n += 1;
            }
            sluice::kafka::Flow::Next
        },
    )
    .unwrap();
    n
}

/// 1,000 tasks of 10 tenants submitted through two gateway instances: each
/// answered 202, each event stream (opened on the other instance) delivers
/// its result exactly once, equal to the record on the results topic, and
/// each status URL serves it on either instance; an idempotent retry on the
/// other instance creates no second task; tokens read only their tenant's
/// tasks; a restarted instance still serves statuses and results.
#[test]
fn submitted_tasks_are_answered_once_over_events_and_status_on_any_instance() {
    let p = Pipeline::new(SimConfig::default(), "[gateway]\nmax_body_bytes = 65536\n");
    let _run = p.start("run");
    let (s1, s2) = (temp_dir(), temp_dir());
    let mut g1 = start_gateway(&p, "gw-1", s1.path());
    let g2 = start_gateway(&p, "gw-2", s2.path());
    wait_for_one_task_each(&p, &[&g1, &g2]);
    let urls = Arc::new([g1.addr, g2.addr]);
    let c = client();

    // 1,000 submissions, 64 at a time, each followed by its event stream on
    // the other instance.
    let outcomes: Vec<Outcome> = p.rt.block_on(async {
        let limit = Arc::new(tokio::sync::Semaphore::new(64));
        let mut jobs = Vec::new();
        for i in 0..1000usize {
            let (c, urls, limit) = (c.clone(), urls.clone(), limit.clone());
            jobs.push(tokio::spawn(async move {
                let tenant = i % 10;
                let body = serde_json::to_vec(&submission(i, TYPES[i % 3])).unwrap();
                let token = tenant_token(tenant);
                let accepted = {
                    let _permit = limit.acquire().await.unwrap();
                    post(
                        &c,
                        format!("http://{}/v1/tasks", urls[i % 2]),
                        Some(&token),
                        &[],
                        body,
                    )
                    .await
                };
                assert_eq!(accepted.status, 202, "task {i}: {}", accepted.body);
                let v = accepted.json();
                let id = v["taskId"].as_str().unwrap().to_string();
                let events_url = format!(
                    "http://{}{}",
                    urls[(i + 1) % 2],
                    v["eventsUrl"].as_str().unwrap()
                );
                let stream = tokio::time::timeout(
                    Duration::from_secs(240),
                    events(&c, events_url, &token, None),
                )
                .await
                .unwrap_or_else(|_| panic!("task {i}: no result event in 240 s"));
                (tenant, id, accepted, stream)
            }));
        }
        let mut out = Vec::new();
        for j in jobs {
            out.push(j.await.unwrap());
        }
        out
    });
    let ids: HashSet<&str> = outcomes.iter().map(|(_, id, _, _)| id.as_str()).collect();
    assert_eq!(ids.len(), 1000, "1,000 distinct task ids");
    let results = results_by_id(&p, 1000);
    for (tenant, id, accepted, (status, evs, _)) in &outcomes {
        assert_eq!(
            accepted.headers.get("location").map(String::as_str),
            Some(format!("/v1/tasks/{id}").as_str())
        );
        assert_eq!(*status, 200, "{id}: event stream status");
        assert_eq!(evs.len(), 1, "{id}: one event, the result: {evs:?}");
        let ev = &evs[0];
        assert_eq!(ev.id.as_deref(), Some("final"));
        let data: Value = serde_json::from_str(&ev.data).unwrap();
        let on_topic = &results[id.as_str()];
        assert_eq!(on_topic.len(), 1, "{id}: one result on the results topics");
        assert_eq!(
            &data["result"], &on_topic[0],
            "{id}: the event carries the result"
        );
        assert_eq!(data["tenantId"], format!("tenant-{tenant}"));
        let want = if on_topic[0]["success"] == true {
            "completed"
        } else {
            "failed"
        };
        assert_eq!(ev.event.as_deref(), Some(want));
        assert_eq!(data["status"], want);
    }
    assert_eq!(results.len(), 1000, "no result of anything else");
    let completed = outcomes
        .iter()
        .filter(|(_, _, _, (_, evs, _))| evs[0].event.as_deref() == Some("completed"))
        .count();
    assert!(completed >= 900, "most tasks complete: {completed}");

    // Status URLs, on both instances; another tenant's id is unknown.
    let sample: Vec<&Outcome> = outcomes.iter().step_by(37).collect();
    p.rt.block_on(async {
        for (tenant, id, _, _) in &sample {
            for g in [&g1, &g2] {
                let a = get(
                    &c,
                    g.url(&format!("/v1/tasks/{id}")),
                    Some(&tenant_token(*tenant)),
                )
                .await;
                assert_eq!(a.status, 200, "{}", a.body);
                assert_eq!(a.json()["result"], results[id.as_str()][0]);
            }
            let other = tenant_token((tenant + 1) % 10);
            let theirs = get(&c, g1.url(&format!("/v1/tasks/{id}")), Some(&other)).await;
            let unknown = get(&c, g1.url("/v1/tasks/no-such-task"), Some(&other)).await;
            assert_eq!(
                (theirs.status, &theirs.body),
                (404, &unknown.body),
                "another tenant's task is unknown"
            );
            // An id no submission can have (a tab) is unknown on the
            // instance holding the tenant and on the one that would forward.
            for g in [&g1, &g2] {
                let odd = get(&c, g.url("/v1/tasks/a%09b"), Some(&tenant_token(*tenant))).await;
                assert_eq!((odd.status, &odd.body), (404, &unknown.body));
            }
            let named = get(
                &c,
                g1.url(&format!("/v1/tasks/{id}?tenant=tenant-{tenant}")),
                Some(&other),
            )
            .await;
            assert_eq!(named.status, 403);
            let admin = get(
                &c,
                g2.url(&format!("/v1/tasks/{id}?tenant=tenant-{tenant}")),
                Some(ADMIN_TOKEN),
            )
            .await;
            assert_eq!(admin.status, 200);
        }
        let none = get(&c, g1.url(&format!("/v1/tasks/{}", sample[0].1)), None).await;
        assert_eq!(none.status, 401);
        assert_eq!(
            none.headers.get("www-authenticate").map(String::as_str),
            Some("Bearer")
        );
    });

    // Bad bodies: the field named; too large: 413.
    p.rt.block_on(async {
        let t0 = tenant_token(0);
        let bad = post(
            &c,
            g1.url("/v1/tasks"),
            Some(&t0),
            &[],
            br#"{"taskType":"summarize","payload":{"maxWords":3}}"#.to_vec(),
        )
        .await;
        assert_eq!(bad.status, 400);
        assert_eq!(bad.json()["field"], "payload.content");
        let bad = post(
            &c,
            g1.url("/v1/tasks"),
            Some(&t0),
            &[],
            b"{not json".to_vec(),
        )
        .await;
        assert_eq!(
            (bad.status, bad.json()["field"].clone()),
            (400, json!("body"))
        );
        let huge = json!({"taskType": "summarize", "payload": {"content": "x".repeat(70_000)}});
        let big = post(
            &c,
            g1.url("/v1/tasks"),
            Some(&t0),
            &[],
            serde_json::to_vec(&huge).unwrap(),
        )
        .await;
        assert_eq!(big.status, 413, "over [gateway] max_body_bytes");
        let task = json!({"taskType": "summarize", "payload": {"content": "x".repeat(5_000)}});
        let big = post(
            &c,
            g1.url("/v1/tasks"),
            Some(&t0),
            &[],
            serde_json::to_vec(&task).unwrap(),
        )
        .await;
        assert_eq!(big.status, 413, "over [tasks] max_bytes");
    });

    // The same POST retried with its Idempotency-Key on the other instance.
    let key = [("idempotency-key", "order-42")];
    let body = serde_json::to_vec(&submission(4242, "summarize")).unwrap();
    let t3 = tenant_token(3);
    let (first, retry) = p.rt.block_on(async {
        let first = post(&c, g1.url("/v1/tasks"), Some(&t3), &key, body.clone()).await;
        let retry = post(&c, g2.url("/v1/tasks"), Some(&t3), &key, body.clone()).await;
        (first, retry)
    });
    assert_eq!(
        (first.status, retry.status),
        (202, 202),
        "{} {}",
        first.body,
        retry.body
    );
    let id = first.json()["taskId"].as_str().unwrap().to_string();
    assert_eq!(retry.json()["taskId"], id, "the key names one task");
    assert_eq!(
        retry.headers.get("idempotent-replayed").map(String::as_str),
        Some("true")
    );
    let (_, evs, _) = p.rt.block_on(events(
        &c,
        g2.url(&format!("/v1/tasks/{id}/events")),
        &t3,
        None,
    ));
    assert_eq!(evs.len(), 1);
    assert_eq!(
        task_records(&p, &id),
        1,
        "one task record for the retried POST"
    );
    let after = results_by_id(&p, 1001);
    assert_eq!(after[&id].len(), 1, "one result for the retried POST");

    let accepted: f64 = [&g1, &g2]
        .iter()
        .map(|g| metric(&p, g, "sluice_gateway_tasks_accepted_total"))
        .sum();
    assert_eq!(accepted, 1001.0);
    let observed: f64 = [&g1, &g2]
        .iter()
        .map(|g| metric(&p, g, "sluice_gateway_accept_to_result_seconds_count"))
        .sum();
    // Once per task whose record its holder read before the result (a
    // result read first has no submission time to count from).
    assert!(
        (950.0..=1001.0).contains(&observed),
        "each result's latency observed at most once, by its holder: {observed}"
    );

    // gw-1 killed and restarted on its state: statuses and results served.
    g1.proc.kill9();
    let g1 = start_gateway(&p, "gw-1b", s1.path());
    wait_ready(&p, &g1);
    wait_ready(&p, &g2);
    p.rt.block_on(async {
        for (tenant, id, _, _) in &sample {
            let token = tenant_token(*tenant);
            let a = eventually_async(|| get(&c, g1.url(&format!("/v1/tasks/{id}")), Some(&token)))
                .await;
            assert_eq!(a.json()["result"], results[id.as_str()][0]);
            let (status, evs, _) =
                events(&c, g1.url(&format!("/v1/tasks/{id}/events")), &token, None).await;
            assert_eq!(
                (status, evs.len()),
                (200, 1),
                "a reconnecting client gets its result"
            );
            let (status, evs, _) = events(
                &c,
                g1.url(&format!("/v1/tasks/{id}/events")),
                &token,
                Some("final"),
            )
            .await;
            assert_eq!((status, evs.len()), (204, 0), "and nothing once it has it");
        }
    });
}

/// Reads until 200 (a rebalance may answer 503 for a moment).
async fn eventually_async<F, Fut>(mut f: F) -> Answer
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Answer>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let a = f().await;
        if a.status == 200 || std::time::Instant::now() > deadline {
            assert_eq!(a.status, 200, "{}", a.body);
            return a;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A tenant at its backlog bound gets 429 with `Retry-After` until its
/// tasks are answered; a batch is all or nothing, its bad task named.
#[test]
fn a_tenant_over_its_backlog_waits_and_a_batch_is_checked_whole() {
    let p = Pipeline::new(
        SimConfig::default(),
        "[gateway]\nmax_backlog_per_tenant = 5\n",
    );
    // No pipeline yet: what is accepted stays pending.
    let state = temp_dir();
    let g = start_gateway(&p, "gw", state.path());
    wait_ready(&p, &g);
    let c = client();
    let t3 = tenant_token(3);
    let backlog = |token: &str| {
        let a =
            p.rt.block_on(get(&c, g.url("/v1/tenants/tenant-3/backlog"), Some(token)));
        assert_eq!(a.status, 200, "{}", a.body);
        a.json()["pending"].as_u64().unwrap()
    };

    // A batch with one bad task publishes nothing.
    let mut tasks: Vec<Value> = (0..3).map(|i| submission(i, TYPES[i])).collect();
    tasks[1]["payload"]
        .as_object_mut()
        .unwrap()
        .remove("content");
    let bad = p.rt.block_on(post(
        &c,
        g.url("/v1/tasks:batch"),
        Some(&t3),
        &[],
        serde_json::to_vec(&json!({"tasks": tasks})).unwrap(),
    ));
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["field"], "tasks[1].payload.content");

    let batch: Vec<Value> = (0..3).map(|i| submission(i, TYPES[i])).collect();
    let ok = p.rt.block_on(post(
        &c,
        g.url("/v1/tasks:batch"),
        Some(&t3),
        &[],
        serde_json::to_vec(&json!({"tasks": batch})).unwrap(),
    ));
    assert_eq!(ok.status, 202, "{}", ok.body);
    let mut ids: Vec<String> = ok.json()["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["taskId"].as_str().unwrap().to_string())
        .collect();
    for i in 3..5 {
        let a = p.rt.block_on(post(
            &c,
            g.url("/v1/tasks"),
            Some(&t3),
            &[],
            serde_json::to_vec(&submission(i, "summarize")).unwrap(),
        ));
        assert_eq!(a.status, 202, "{}", a.body);
        ids.push(a.json()["taskId"].as_str().unwrap().to_string());
    }
    eventually(Duration::from_secs(30), "five pending", || {
        (backlog(&t3) == 5).then_some(())
    });
    for id in &ids {
        let a =
            p.rt.block_on(get(&c, g.url(&format!("/v1/tasks/{id}")), Some(&t3)));
        assert_eq!(a.json()["status"], "pending");
    }
    // Another tenant's token does not read tenant-3's backlog.
    let other = p.rt.block_on(get(
        &c,
        g.url("/v1/tenants/tenant-3/backlog"),
        Some(&tenant_token(4)),
    ));
    assert_eq!(other.status, 403);

    std::thread::sleep(Duration::from_millis(300));
    let refused = p.rt.block_on(post(
        &c,
        g.url("/v1/tasks"),
        Some(&t3),
        &[],
        serde_json::to_vec(&submission(9, "summarize")).unwrap(),
    ));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert!(refused
        .headers
        .get("retry-after")
        .is_some_and(|s| s.parse::<u64>().is_ok()));
    // Other tenants are not held back.
    let t4 = p.rt.block_on(post(
        &c,
        g.url("/v1/tasks"),
        Some(&tenant_token(4)),
        &[],
        serde_json::to_vec(&submission(10, "classify")).unwrap(),
    ));
    assert_eq!(t4.status, 202);
    assert_eq!(
        metric(
            &p,
            &g,
            "sluice_gateway_tasks_rejected_total{reason=\"backlog\"}"
        ),
        1.0
    );

    // The pipeline answers them: the backlog empties and tasks are taken again.
    let _run = p.start("run");
    let long_poll = p.rt.block_on(get(
        &c,
        g.url(&format!("/v1/tasks/{}?wait=30s", ids[0])),
        Some(&t3),
    ));
    assert_ne!(
        long_poll.json()["status"],
        "pending",
        "a long poll returns with the result"
    );
    eventually(Duration::from_secs(60), "the backlog empties", || {
        (backlog(&t3) == 0).then_some(())
    });
    std::thread::sleep(Duration::from_millis(300));
    let again = p.rt.block_on(post(
        &c,
        g.url("/v1/tasks"),
        Some(&t3),
        &[],
        serde_json::to_vec(&submission(11, "summarize")).unwrap(),
    ));
    assert_eq!(again.status, 202, "{}", again.body);
    let by_id: BTreeMap<String, Vec<Value>> = results_by_id(&p, 7).into_iter().collect();
    for id in &ids {
        assert_eq!(by_id[id].len(), 1, "{id} answered once");
    }
}

#[test]
fn a_refusal_sent_before_the_body_was_read_closes_its_connection() {
    // Refused on its headers (a declared length over `[gateway]
    // max_body_bytes`, no token), a request's body is left unread, and the
    // gateway ends the connection after the answer. The answer says so
    // (`Connection: close`): a client that pooled the connection would send
    // its next request into a socket being closed and get no answer.
    let p = Pipeline::new(SimConfig::default(), "[gateway]\nmax_body_bytes = 65536\n");
    let state = temp_dir();
    let g = start_gateway(&p, "gw", state.path());
    wait_ready(&p, &g);
    let c = client();
    let t0 = tenant_token(0);
    let huge = serde_json::to_vec(&submission_of("summarize", &"x".repeat(200_000))).unwrap();
    let fits = serde_json::to_vec(&submission_of("summarize", &"x".repeat(60_000))).unwrap();
    let next = br#"{"taskType":"summarize","payload":{"maxWords":3}}"#.to_vec();
    p.rt.block_on(async {
        for round in 0..50 {
            for (token, body, status) in [(Some(t0.as_str()), &huge, 413), (None, &fits, 401)] {
                let refused = post(&c, g.url("/v1/tasks"), token, &[], body.clone()).await;
                assert_eq!(refused.status, status, "round {round}: {}", refused.body);
                assert_eq!(
                    refused.headers.get("connection").map(String::as_str),
                    Some("close"),
                    "round {round}: a {status} with its body unread"
                );
                // The client's next request, on a pooled connection if it
                // kept one, is answered.
                let answered = post(&c, g.url("/v1/tasks"), Some(&t0), &[], next.clone()).await;
                assert_eq!(answered.status, 400, "round {round}: {}", answered.body);
                assert_ne!(
                    answered.headers.get("connection").map(String::as_str),
                    Some("close"),
                    "a body read to its end keeps the connection"
                );
            }
        }
    });
}

/// A tenant whose hard quota made the pipeline refuse a task gets 429
/// (`quota`) with `Retry-After` until its window ends; other tenants are
/// accepted.
#[test]
fn a_tenant_whose_hard_quota_is_used_up_is_refused_at_the_door() {
    let p = Pipeline::new(
        SimConfig::default(),
        "[accounting]\nenabled = true\n\n[accounting.quotas.tenants.tenant-5]\nwindow = \"1h\"\ntokens = 400\n",
    );
    let _run = p.start("run");
    let state = temp_dir();
    let g = start_gateway(&p, "gw", state.path());
    wait_ready(&p, &g);
    let c = client();
    let t5 = tenant_token(5);
    let submit = |token: &str, i: usize| {
        p.rt.block_on(post(
            &c,
            g.url("/v1/tasks"),
            Some(token),
            &[],
            serde_json::to_vec(&submission(i, "summarize")).unwrap(),
        ))
    };
    // One task at a time, each waited for, until the pipeline refuses one.
    let mut refused = false;
    for i in 0..50 {
        let a = submit(&t5, i);
        assert_eq!(a.status, 202, "{}", a.body);
        let id = a.json()["taskId"].as_str().unwrap().to_string();
        let s = p.rt.block_on(get(
            &c,
            g.url(&format!("/v1/tasks/{id}?wait=30s")),
            Some(&t5),
        ));
        let v = s.json();
        assert_ne!(v["status"], "pending", "answered within 30 s");
        if v["result"]["errorCode"] == "quota_exceeded" {
            refused = true;
            break;
        }
    }
    assert!(
        refused,
        "tenant-5's quota of 400 tokens an hour refuses a task"
    );
    // Once the table's commit makes it readable.
    eventually(Duration::from_secs(10), "the quota window marked", || {
        let backlog =
            p.rt.block_on(get(&c, g.url("/v1/tenants/tenant-5/backlog"), Some(&t5)));
        backlog.json()["quotaExhaustedUntil"]
            .is_string()
            .then_some(())
    });
    // Past the admission cache's freshness.
    std::thread::sleep(Duration::from_millis(300));
    let at_door = submit(&t5, 100);
    assert_eq!(at_door.status, 429, "{}", at_door.body);
    let retry: u64 = at_door.headers["retry-after"].parse().unwrap();
    assert!((1..=3600).contains(&retry), "until the hour ends: {retry}");
    assert_eq!(
        metric(
            &p,
            &g,
            "sluice_gateway_tasks_rejected_total{reason=\"quota\"}"
        ),
        1.0
    );
    assert_eq!(
        submit(&tenant_token(6), 101).status,
        202,
        "other tenants go on"
    );
}
