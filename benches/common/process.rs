//! The start of a `sluice run` or `sluice gateway` a bench talks to over HTTP.

/// Spawns `command` (a `sluice run` or `sluice gateway`, `SLUICE_LOG=warn`
/// unless `SLUICE_BENCH_LOG` gives another filter)
/// and waits for the address its HTTP listener prints (`LISTENING <addr>`);
/// its further output is read and dropped.
pub fn spawn_listening(mut command: std::process::Command) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = command
        .env(
            "SLUICE_LOG",
            std::env::var("SLUICE_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("sluice listens").unwrap();
        if let Some(a) = line.strip_prefix("LISTENING ") {
            break a.trim().to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    (child, addr)
}
