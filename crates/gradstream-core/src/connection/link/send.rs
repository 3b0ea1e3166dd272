//! A link's sending side: a gradient or a tensor set checked against what the peer said
//! it takes, written sealed, then the wait for the peer's acknowledgement
//! (docs/guides/connections.md "Delivery").

use super::*;

impl Link {
    /// Refuse, before a byte is sent, what the peer said it would refuse: more values
    /// than its max_gradient_len, a first chunk (the largest, uncompressed) whose payload
    /// is over its max_payload_len. The payload is measured as float32 (the size known
    /// without encoding), so only for a gradient travelling as float32: another wire
    /// dtype's payload (int8's is a quarter) is held to the limit as it is encoded.
    pub(super) fn check_fits(&self, config: &SessionConfig, gradient: &Gradient<'_>) -> Result<()> {
        let values = gradient.len();
        let Mode::Sealed(keys) = &self.mode else {
            return Ok(());
        };
        let hello = &keys.established.peer_hello;
        let at = self.peer.address.at();
        let peer = at.as_ref();
        hello.check_gradient_len(values, peer)?;
        if !gradient.travels_as_float32() {
            return Ok(());
        }
        // Measured as this side will send it: sealed.
        let sealed = SessionConfig {
            seal: true,
            ..config.clone()
        };
        let chunk = config.chunk_size.min(values.max(1));
        let payload = sealed.frames_len(chunk)?.saturating_sub(HEADER_LEN);
        hello.check_payload_len(0, payload, peer)
    }

    /// Send one gradient; the number of chunks, once the peer has acknowledged it.
    pub async fn send_gradient(
        &mut self,
        config: &SessionConfig,
        gradient: Gradient<'_>,
        waits: Waits,
        progress: &Progress,
    ) -> Result<usize> {
        self.check_fits(config, &gradient)?;
        self.begin().await?;
        let sent = self
            .send_gradient_begun(config, gradient, waits, progress)
            .await;
        self.end(sent)
    }

    pub(super) async fn send_gradient_begun(
        &mut self,
        config: &SessionConfig,
        gradient: Gradient<'_>,
        waits: Waits,
        progress: &Progress,
    ) -> Result<usize> {
        let clock = Clock::running(waits);
        let Mode::Sealed(keys) = &self.mode else {
            let sent = send_gradient_on(config, gradient, &mut self.stream, &clock, progress).await;
            return match sent {
                Ok(n) => Ok(n),
                Err(e) => self.fail(e).await,
            };
        };
        let id = keys.id(true);
        let sealed = gradient.sealed(Seal::lone(id));
        if self.striped() {
            self.gather(&clock).await?;
            if self.resumable() {
                return self
                    .send_resumable(config, sealed, id, &clock, progress)
                    .await;
            }
            let (sent, digest) = match self
                .send_striped(config, sealed, id, &clock, progress)
                .await
            {
                Ok((sent, digest)) => (Ok(sent), digest),
                Err(e) => (Err(e), [0; 32]),
            };
            return self.acknowledged(sent, digest, &clock).await;
        }
        if self.resumes() {
            self.gather(&clock).await?;
            return self
                .send_resumable_one(config, sealed, id, &clock, progress)
                .await;
        }
        let mut tap = Tap::new(&mut self.stream, Digest::new(&id.0));
        let sent = send_gradient_on(config, sealed, &mut tap, &clock, progress).await;
        let digest = tap.finish();
        self.acknowledged(sent, digest, &clock).await
    }

    /// Send a tensor set; the number of frames, once the peer has acknowledged it.
    pub async fn send_tensors(
        &mut self,
        config: &SessionConfig,
        wire_dtype: Option<WireDtype>,
        tensors: &[(Entry, Gradient<'_>)],
        waits: Waits,
        progress: &Progress,
    ) -> Result<usize> {
        // A set is not checked against the peer's limits here: its receiver refuses the
        // manifest of a set over them, as docs/guides/connections.md says (and the reference).
        self.begin().await?;
        let sent = self
            .send_tensors_begun(config, wire_dtype, tensors, waits, progress)
            .await;
        self.end(sent)
    }

    pub(super) async fn send_tensors_begun(
        &mut self,
        config: &SessionConfig,
        wire_dtype: Option<WireDtype>,
        tensors: &[(Entry, Gradient<'_>)],
        waits: Waits,
        progress: &Progress,
    ) -> Result<usize> {
        let Mode::Sealed(keys) = &self.mode else {
            let sent = tensors::send_tensors(
                config,
                wire_dtype,
                tensors,
                &mut self.stream,
                waits,
                progress,
            )
            .await;
            return match sent {
                Ok(n) => Ok(n),
                Err(e) => self.fail(e).await,
            };
        };
        let clock = Clock::running(waits);
        let id = keys.id(true);
        let mut tap = Tap::new(&mut self.stream, Digest::new(&id.0));
        let sent = tensors::send_tensors_sealed(
            config, wire_dtype, tensors, id, &mut tap, waits, progress,
        )
        .await;
        let digest = tap.finish();
        self.acknowledged(sent, digest, &clock).await
    }

    /// After the frames of an outgoing transfer: the peer's ack, checked against what
    /// was sent.
    pub(super) async fn acknowledged(
        &mut self,
        sent: Result<usize>,
        digest: [u8; 32],
        clock: &Clock,
    ) -> Result<usize> {
        let at = self.peer.address.at();
        let peer = at.as_ref();
        let sent = match sent {
            Ok(n) => n,
            // A stall is the caller's to see as such; anything else (a reset, a closed
            // pipe) may be the peer refusing mid-way: its refusal may be waiting.
            Err(GradientStreamError::Io(io)) => {
                let error = match tokio::time::timeout(LINGER, self.read_ack()).await {
                    Ok(Ok(
                        ack @ Ack {
                            verdict: Verdict::Refused { .. },
                            ..
                        },
                    )) => ack.confirm(0, &digest, peer).err(),
                    _ => None,
                };
                let error = error.unwrap_or_else(|| {
                    self.delivery(
                        format!(
                            "the connection failed before the peer acknowledged the transfer: \
                             {io}"
                        ),
                        None,
                    )
                });
                return self.fail(error).await;
            }
            Err(e) => return self.fail(e).await,
        };
        let Mode::Sealed(keys) = &self.mode else {
            return Ok(sent);
        };
        let counter = keys.sent;
        let total = u32::try_from(sent).ok();
        let read = within(clock, (sent, total), async { Ok(self.read_ack().await) }).await;
        let checked = match read {
            Ok(Ok(ack)) => ack.confirm(counter, &digest, peer),
            Ok(Err(e)) | Err(e) => Err(e),
        };
        match checked {
            Ok(()) => {
                if let Mode::Sealed(keys) = &mut self.mode {
                    keys.sent += 1;
                }
                Ok(sent)
            }
            Err(e) => self.fail(e).await,
        }
    }

    /// The peer's next ack: its first 16 bytes checked, then the rest they announce.
    pub(super) async fn read_ack(&mut self) -> Result<Ack> {
        let at = self.peer.address.at();
        let peer = at.as_ref();
        let ended = |link: &Self| {
            link.delivery(
                "the connection ended before the peer acknowledged the transfer".into(),
                None,
            )
        };
        let mut start = [0u8; START_LEN];
        let read = read_full(&mut self.stream, &mut start).await;
        if !matches!(read, Ok(Ok(()))) {
            return Err(read.map_or_else(|e| self.ack_failed(e), |_| ended(self)));
        }
        let mut ack = vec![0u8; START_LEN + Ack::check_start(&start, peer)?];
        ack[..START_LEN].copy_from_slice(&start);
        let read = read_full(&mut self.stream, &mut ack[START_LEN..]).await;
        if !matches!(read, Ok(Ok(()))) {
            return Err(read.map_or_else(|e| self.ack_failed(e), |_| ended(self)));
        }
        Ack::parse(&ack, peer)
    }

    pub(super) fn ack_failed(&self, error: std::io::Error) -> GradientStreamError {
        self.delivery(
            format!("the connection failed before the peer acknowledged the transfer: {error}"),
            None,
        )
    }
}
