package node

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/store"
)

// unavailableRetry is how soon a get that waits looks its name up again
// after the directory did not answer, should no change wake it first.
const unavailableRetry = time.Second

// untilFetched runs fetch, which makes local what a get asks for. For a
// get that waits (sel.Wait) it runs it again at every change of the name
// the directory shows (Mirror.Changed: a node creates it, a holder joins,
// a version is committed, the directory is back after an outage) until it
// succeeds, fails for good, or ctx ends: nil then, and the get goes on (a
// local seal answers it, or it times out as it would have). To a get that
// waits, a name not in the cluster yet and a directory that does not
// answer are alike: the name may still come, from any node. A get that
// does not wait has one try: a name not in the cluster lets it go on as
// without one (store.ErrNotFound), a directory away fails it
// (cluster.ErrUnavailable).
func (n *Node) untilFetched(ctx context.Context, owner uint32, name string, sel store.ClusterGet, fetch func() error) error {
	if !sel.Wait {
		return storeNotFound(fetch())
	}
	n.waitingGets.Add(1)
	defer n.waitingGets.Add(-1)
	told := false
	for {
		changed, done := n.mirror.Changed(owner, name)
		err := fetch()
		away := errors.Is(err, cluster.ErrUnavailable)
		if err == nil || ctx.Err() != nil || !away && !errors.Is(err, cluster.ErrNotFound) && !errors.Is(err, store.ErrNotFound) {
			done()
			if ctx.Err() != nil {
				return nil
			}
			return storeNotFound(err)
		}
		var retry <-chan time.Time
		if away {
			if !told {
				n.log.Warn("cluster directory unavailable: the get waits for it to come back, and for a local seal", "name", name, "owner", owner, "err", err)
				told = true
			}
			retry = time.After(unavailableRetry)
		}
		select {
		case <-changed:
		case <-retry:
		case <-ctx.Done():
		}
		done()
	}
}

// storeNotFound makes cluster.ErrNotFound the store's ErrNotFound: the
// get goes on as on a daemon without a cluster.
func storeNotFound(err error) error {
	if errors.Is(err, cluster.ErrNotFound) && !errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("%w: %v", store.ErrNotFound, err)
	}
	return err
}

// latestNewer returns the latest version of owner's versioned name when it
// is newer than after, from the mirror where it shows one, else from etcd
// (the mirror may lag behind a publish that returned on another node). It
// fails with cluster.ErrNotFound while there is none.
func (n *Node) latestNewer(ctx context.Context, owner uint32, name string, after uint64) (cluster.Latest, error) {
	if l, ok := n.mirror.Latest(owner, name); ok && l.Version > after {
		return l, nil
	}
	l, err := n.dir.Latest(ctx, owner, name)
	if err == nil && l.Version <= after {
		err = fmt.Errorf("no version of %d:%s newer than %d in the cluster: %w", owner, name, after, cluster.ErrNotFound)
	}
	return l, err
}
