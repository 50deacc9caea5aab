package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/store"
)

// Partial replicas: a get that names some tensors of a bundle this node
// does not hold reads only those tensors' byte ranges from the holders
// (cluster.Puller.PullRangesEntry) into a slice of the store
// (store.Replicas.CreateSlice): an object of its own, laid out by
// cluster.TensorSlice, with a manifest of just those tensors. A slice is
// this node's alone: it is never advertised as a holder of the bundle, and
// no peer reads from it. A repeat get of the same tensors (of the same
// incarnation and version) leases it again without reading anything; a get
// of the whole bundle pulls the whole, which drops the slices it makes
// redundant; a slice of a newer version drops the older versions' slices;
// the cluster deleting the name drops them all (store.Replicas.Drop).
//
// A slice of a GPU bundle goes on this daemon's first GPU, as a replica of
// the whole would: the holder exposes the bundle as it does for any pull
// (staged device→host whole, or its GPU arena where UCX registers CUDA
// memory), the reader's ranges land in a pinned host buffer and go
// host→device in one copy.

// slicePulls makes concurrent gets of one slice share one read.
type slicePulls struct {
	mu sync.Mutex
	m  map[string]*sliceCall
}

type sliceCall struct {
	done chan struct{}
	name string
	err  error
}

// FetchTensors implements store.ClusterHook: it answers a get of some
// tensors (sel.Tensors) of owner's bundle name, as Fetch would answer a
// get of the whole, with a slice holding just those tensors.
func (n *Node) FetchTensors(ctx context.Context, reader, owner uint32, name string, sel store.ClusterGet) (slice string, err error) {
	err = n.untilFetched(ctx, owner, name, sel, func() (err error) {
		if slice, err = n.fetchTensors(ctx, reader, owner, name, sel); err != nil {
			slice = ""
		}
		return err
	})
	return slice, err
}

func (n *Node) fetchTensors(ctx context.Context, reader, owner uint32, name string, sel store.ClusterGet) (string, error) {
	var slice string
	err := n.withRecord(ctx, owner, name, sel, sel.Shard, func(e cluster.Entry) error {
		var err error
		slice, err = n.slice(ctx, reader, e, sel.Tensors)
		return err
	})
	return slice, err
}

// slice returns the name of the sealed slice of tensors of e's bundle,
// reading it first when this node lacks it.
func (n *Node) slice(ctx context.Context, reader uint32, e cluster.Entry, tensors []string) (string, error) {
	ref := e.Ref()
	if !readable(e, reader) {
		return "", fmt.Errorf("%s: %w", ref, store.ErrNotFound) // not the reader's to read
	}
	if len(e.Manifest) == 0 {
		return "", fmt.Errorf("%w: %s is not a bundle: it has no tensors to pick (get it without tensors)", store.ErrInvalid, ref)
	}
	m, err := bundle.Parse(e.Manifest)
	if err != nil {
		return "", fmt.Errorf("%w: %s: manifest: %v", cluster.ErrBadRecord, ref, err)
	}
	sm, size, ranges, err := cluster.TensorSlice(m, tensors)
	if err != nil {
		if errors.Is(err, cluster.ErrNoTensor) {
			err = fmt.Errorf("%w: %s: %v", store.ErrInvalid, ref, err)
		}
		return "", err
	}
	sl := store.ClusterSlice{
		Of: store.ClusterObject{Owner: e.Owner, Name: e.Name, Size: e.Size, Shared: e.Shared,
			Version: e.Version, Shard: e.Shard, Shards: e.Shards, ID: e.ID, GPU: e.GPU},
		Key: sliceKey(tensors), Size: max(size, 1), Manifest: sm.Marshal(),
	}
	key := ref.String() + "/" + e.ID + "/" + sl.Key
	n.slicing.mu.Lock()
	if c := n.slicing.m[key]; c != nil {
		n.slicing.mu.Unlock()
		select {
		case <-c.done:
			return c.name, c.err
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	c := &sliceCall{done: make(chan struct{})}
	if n.slicing.m == nil {
		n.slicing.m = map[string]*sliceCall{}
	}
	n.slicing.m[key] = c
	n.slicing.mu.Unlock()
	c.name, c.err = n.makeSlice(ctx, e, sl, ranges, size)
	n.slicing.mu.Lock()
	delete(n.slicing.m, key)
	n.slicing.mu.Unlock()
	close(c.done)
	return c.name, c.err
}

// makeSlice returns the slice sl of e's bundle, reading ranges (size
// bytes) into it when the store lacks it.
func (n *Node) makeSlice(ctx context.Context, e cluster.Entry, sl store.ClusterSlice, ranges []cluster.Range, size int64) (string, error) {
	name, f, err := n.st.CreateSlice(sl)
	if err != nil {
		return "", fmt.Errorf("node %s: slice of %s: %w", n.cfg.Directory.Node, e.Ref(), err)
	}
	if f == nil {
		return name, nil // read before
	}
	defer f.Release() // removes it unless sealed
	var read int64
	switch {
	case size == 0:
		// Tensors of no bytes: nothing to read.
		if f.File != nil {
			f.File.Close()
		}
	case f.GPU != nil:
		// A slice on a GPU: the ranges land in pinned host memory, then
		// go host→device at once.
		b, err := n.pinned.get(f.GPU.Device, size)
		if err != nil {
			return "", fmt.Errorf("node %s: slice of %s: %w", n.cfg.Directory.Node, e.Ref(), err)
		}
		defer n.pinned.put(b)
		if read, err = n.p.PullRangesEntry(ctx, e, ranges, b.mem[:size]); err != nil {
			return "", err
		}
		if err := f.GPU.Device.CopyToDevice(f.GPU.Ptr, b.mem[:size]); err != nil {
			return "", fmt.Errorf("node %s: copy a slice of %s host→device: %w", n.cfg.Directory.Node, e.Ref(), err)
		}
		n.stagedBytes.Add(uint64(size))
	default:
		mem, whole, err := mapRange(f.File, f.Offset, f.Size, unix.PROT_READ|unix.PROT_WRITE)
		f.File.Close()
		if err != nil {
			return "", err
		}
		read, err = n.p.PullRangesEntry(ctx, e, ranges, mem[:size])
		unix.Munmap(whole)
		if err != nil {
			return "", err
		}
	}
	if err := f.Seal(); err != nil {
		return "", err
	}
	n.log.Debug("partial replica read", "object", e.Ref().String(), "tensors", len(ranges), "size", size, "read", read, "of", e.Size)
	if e.Version != 0 {
		n.st.DropSlices(e.Owner, e.Name, e.Version)
	}
	return name, nil
}

// sliceKey names a set of tensors: the same names in any order give the
// same key.
func sliceKey(tensors []string) string {
	s := slices.Clone(tensors)
	slices.Sort(s)
	h := sha256.New()
	for _, t := range s {
		h.Write([]byte(strconv.Itoa(len(t))))
		h.Write([]byte{':'})
		h.Write([]byte(t))
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}
