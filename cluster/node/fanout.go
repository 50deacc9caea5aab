package node

import (
	"fmt"
	"sync"

	"github.com/cudaipc/cudaipc/cluster"
)

// feedRefs counts a replica's exposures to peers while it is pulled (it is
// a cluster.ExposableReplica), so that its store session, which keeps its
// memory, ends only when the pull is over and every exposure released.
type feedRefs struct {
	mu    sync.Mutex
	refs  int
	ended bool // Seal or Abort ran: the session ends with the last exposure
	done  bool // the session ended
}

// Expose implements cluster.ExposableReplica: peers read the replica
// while it is pulled (fan-out). Its memory stays the replica's until
// release, sealed, aborted or not.
func (r *replica) Expose() (cluster.Exposure, func(), error) {
	r.feeds.mu.Lock()
	defer r.feeds.mu.Unlock()
	if r.feeds.ended {
		return cluster.Exposure{}, nil, fmt.Errorf("%s: %w (its pull is over)", r.o.Ref(), cluster.ErrNotFound)
	}
	e, rel, err := r.n.exposeArena(r.f)
	if err != nil {
		return e, nil, err
	}
	r.feeds.refs++
	var once sync.Once
	return e, func() {
		once.Do(func() {
			rel()
			r.feeds.mu.Lock()
			r.feeds.refs--
			last := r.feeds.ended && r.feeds.refs == 0 && !r.feeds.done
			r.feeds.done = r.feeds.done || last
			r.feeds.mu.Unlock()
			if last {
				r.release()
			}
		})
	}, nil
}

// end is called once the pull sealed or aborted the replica: its session
// ends now, or with its last exposure.
func (r *replica) end() {
	r.feeds.mu.Lock()
	r.feeds.ended = true
	now := r.feeds.refs == 0 && !r.feeds.done
	r.feeds.done = r.feeds.done || now
	r.feeds.mu.Unlock()
	if now {
		r.release()
	}
}

func (r *replica) release() {
	r.f.File.Close()
	r.f.Release()
}
