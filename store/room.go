package store

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/store/internal/alloc"
)

// Making room on a daemon in a cluster. A cluster-visible object sealed
// here (created cluster-visible, or a replica) may be the cluster's only
// copy: it is evicted to make room only when the cluster hook vouches, for
// the create that needs the room, that another live node holds the same
// incarnation (ClusterHook.MayEvict). The hook is asked without the
// store's lock, only once a create found no room otherwise, and its answer
// is used by that create alone: a holder that dies afterwards is never
// vouched for by an old answer. Node-local objects are evicted as on a
// daemon alone.

// vouchTimeout bounds how long a create waits for the hook's answer.
const vouchTimeout = 5 * time.Second

// roomAsk is a create's failure for want of room that evicting the
// cluster-visible objects objs (with their descriptions cos) might make.
type roomAsk struct {
	objs []*object
	cos  []ClusterObject
}

func (*roomAsk) Error() string {
	return "store: making room needs the cluster's word on its objects"
}

// mayEvictLocked says whether the evictable object o may go for a create
// whose cluster answer is vouched: a cluster-visible object only where
// vouched names its incarnation.
func mayEvictLocked(o *object, vouched map[*object]string) bool {
	if o.cluster == nil {
		return true
	}
	return o.cluster.id != "" && vouched[o] == o.cluster.id
}

// roomAskLocked returns the cluster-visible objects of owner's pools on d
// that eviction could take but for the cluster's word, nil when there are
// none.
func (s *Store) roomAskLocked(d *device, owner uint32) *roomAsk {
	if s.cfg.Cluster == nil {
		return nil
	}
	var ask roomAsk
	d.alloc.Blocks(func(p pool) bool { return p.owner == owner }, func(b *alloc.Block[pool, *object]) bool {
		if o := b.Value; b.Evictable() && o.clusterID() != "" && o.state == stateSealed {
			ask.objs = append(ask.objs, o)
			ask.cos = append(ask.cos, o.clusterObject())
		}
		return true
	})
	if len(ask.objs) == 0 {
		return nil
	}
	return &ask
}

// vouch asks the cluster hook which of ask's objects may go, and returns
// them with the incarnation it vouched for (never nil).
func (s *Store) vouch(ctx context.Context, ask *roomAsk) map[*object]string {
	vouched := map[*object]string{}
	ctx, cancel := context.WithTimeout(ctx, vouchTimeout)
	defer cancel()
	ok := s.cfg.Cluster.MayEvict(ctx, ask.cos)
	for i, o := range ask.objs {
		if i < len(ok) && ok[i] {
			vouched[o] = ask.cos[i].ID
		}
	}
	s.log.Debug("cluster vouched for objects to evict", "asked", len(ask.objs), "vouched", len(vouched))
	return vouched
}

// roomHeldLocked says what holds the room of owner's pools on d that a
// create could not get: objects by why they stay (a create evicts none of
// another uid's).
func (s *Store) roomHeldLocked(d *device, owner uint32, vouched map[*object]string) string {
	type held struct {
		n    int
		size int64
	}
	var last, leased, drafts, versions, pools, evictable, others held
	d.alloc.Blocks(func(pool) bool { return true }, func(b *alloc.Block[pool, *object]) bool {
		o := b.Value
		var h *held
		switch {
		case o.owner != owner:
			h = &others
		case o.kvpool != nil:
			h = &pools
		case o.ver != nil:
			h = &versions
		case !o.sealed():
			h = &drafts
		case o.leases > 0 || o.state == stateDeleted:
			h = &leased
		case !mayEvictLocked(o, vouched):
			h = &last
		default:
			h = &evictable
		}
		h.n++
		h.size += o.size
		return true
	})
	var parts []string
	add := func(h held, one, many string) {
		if h.n == 0 {
			return
		}
		what, noun := many, "objects"
		if h.n == 1 {
			what, noun = one, "object"
		}
		parts = append(parts, fmt.Sprintf("%d %s, %s, %s", h.n, noun, bytesize.Format(h.size), what))
	}
	add(last, "is a last copy in the cluster (no other live node holds it, or the directory cannot say)",
		"are last copies in the cluster (no other live node holds them, or the directory cannot say)")
	add(leased, "is leased", "are leased")
	add(drafts, "is being written", "are being written")
	add(versions, "is a kept version's shard", "are kept versions' shards")
	add(pools, "is a KV block pool's memory", "are KV block pools' memory")
	add(evictable, "could go but would not free a range large enough", "could go but would not free a range large enough")
	add(others, "is another uid's", "are other uids'")
	if len(parts) == 0 {
		return "nothing is held"
	}
	return "the room is held: " + strings.Join(parts, "; ")
}
