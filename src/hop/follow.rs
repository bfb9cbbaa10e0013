//! The follower task: the decode hop follows the topology's decode endpoint (and how its
//! instances are reached).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::advert::SetLink;
use crate::decode::FollowingDecode;
use crate::discovery::{Discovery, EndpointId};
use crate::topology::TopologySnapshot;

/// The follower task: retarget on every change of the topology's decode endpoint.
pub(crate) async fn follow(
    decode: Arc<FollowingDecode>,
    discovery: Arc<dyn Discovery>,
    mut topology: watch::Receiver<TopologySnapshot>,
    catch_up: Duration,
    cancel: CancellationToken,
    changed: watch::Sender<()>,
) {
    let mut current: Option<(EndpointId, Option<SetLink>)> = None;
    let mut first = true;
    loop {
        let wanted = {
            let snapshot = topology.borrow_and_update();
            snapshot
                .decode
                .clone()
                .map(|endpoint| (endpoint, snapshot.decode_link))
        };
        if first || wanted != current {
            first = false;
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                () = decode.retarget(&discovery, wanted.clone(), catch_up, &cancel) => {}
            }
            current = wanted;
            changed.send_replace(());
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            result = topology.changed() => if result.is_err() { break },
        }
    }
}
