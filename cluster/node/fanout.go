package node

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/store"
)

// feedRefs counts a replica's exposures to peers while it is pulled (it has
// cluster.ReplicaTraits.Expose), so that its store session, which keeps its
// memory, ends only when the pull is over and every exposure released.
type feedRefs struct {
	mu    sync.Mutex
	refs  int
	ended bool // Seal or Abort ran: the session ends with the last exposure
	done  bool // the session ended
	// held leases a sealed replica that its pull then aborted (dropping
	// its name), while exposures remain: its memory is freed only once
	// the last is released, never under a peer's read.
	held *store.ClusterFile
}

// Expose is a host replica's ReplicaTraits.Expose: peers read the replica
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
	r.feeds.mu.Lock()
	held := r.feeds.held
	r.feeds.held = nil
	r.feeds.mu.Unlock()
	if held != nil {
		if held.File != nil {
			held.File.Close()
		}
		held.Release()
	}
}

// detachWhileExposed frees the name of an unsealed replica whose pull
// aborted while peers still hold exposures of it: its memory stays until
// the last is released, and a retry of the pull can make a new replica of
// the name meanwhile (else it would fail, the name taken, until every peer
// had let go). A shard beside other shards of its version made here stays
// its version's (store.ClusterFile.Detach).
func (r *replica) detachWhileExposed() {
	r.feeds.mu.Lock()
	defer r.feeds.mu.Unlock()
	if !r.feeds.done {
		r.f.Detach()
	}
}

// holdWhileExposed leases the sealed replica, before its aborted pull
// drops its name, where peers still hold exposures of it: the store then
// frees its memory with the last exposure's release (release), not while
// a peer reads it (or reads what the store put there next).
func (r *replica) holdWhileExposed() {
	r.feeds.mu.Lock()
	defer r.feeds.mu.Unlock()
	if r.feeds.done {
		return
	}
	f, err := r.n.st.Lease(r.o.Owner, r.o.Name, r.o.Version, r.o.Shard, r.o.ID)
	if err != nil {
		// Already gone (deleted here meanwhile): nothing to keep, and
		// the exposures' reads fail their checksums at worst.
		r.n.log.Warn("keeping an aborted replica for the peers that read it failed", "object", r.o.Ref(), "err", err)
		return
	}
	r.feeds.held = f
}

// Expose is a GPU replica's ReplicaTraits.Expose while it is being
// pulled: peers read its pinned landing buffer, whatever chunks it holds
// yet (the puller tells them which are in and checked), never its GPU
// memory. The buffer is registered with UCX once and keeps the
// registration in the pool, as exposeGPU's buffers do, and goes back to
// the pool (to be reused) only once the pull is over and every exposure
// released; the replica's store session ends with the pull, as without
// fan-out.
func (r *gpuReplica) Expose() (cluster.Exposure, func(), error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return cluster.Exposure{}, nil, fmt.Errorf("%s: %w (its pull is over)", r.o.Ref(), cluster.ErrNotFound)
	}
	if r.b.reg == nil {
		start := time.Now()
		reg, err := r.n.tr.Register(r.b.mem)
		if err != nil {
			return cluster.Exposure{}, nil, fmt.Errorf("register a pinned landing buffer with UCX: %w", err)
		}
		r.b.reg = reg
		r.n.registerNanos.Add(int64(time.Since(start)))
	}
	key, closeWindow, err := r.b.reg.Window(0, r.o.Size)
	if err != nil {
		return cluster.Exposure{}, nil, err
	}
	r.exposed++
	e := cluster.Exposure{Worker: r.n.tr.WorkerAddress(), RKey: key, Addr: r.b.reg.Addr(0), Size: r.o.Size}
	r.n.exposures.Add(1)
	r.n.exposedBytes.Add(uint64(r.o.Size))
	var once sync.Once
	return e, func() {
		once.Do(func() {
			closeWindow()
			r.mu.Lock()
			r.exposed--
			last := r.done && r.exposed == 0
			r.mu.Unlock()
			if last {
				r.n.pinned.put(r.b)
			}
		})
	}, nil
}

// Traits implements cluster.Replica: peers may read a host replica while
// it is pulled.
func (r *replica) Traits() cluster.ReplicaTraits {
	return cluster.ReplicaTraits{Expose: r.Expose}
}

// HoldsReplica implements cluster.ReplicaChecker: whether this node holds
// the sealed replica, by leasing it and letting it go, where an exposure
// of a GPU replica would stage it to host memory.
func (s source) HoldsReplica(ref cluster.Ref, id string) error {
	f, err := s.n.st.Lease(ref.Owner, ref.Name, ref.Version, ref.Shard, id)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			err = fmt.Errorf("%w: %v", cluster.ErrNotFound, err)
		}
		return err
	}
	if f.File != nil {
		f.File.Close()
	}
	f.Release()
	return nil
}
