package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/cudaipc/cudaipc/protocol"
)

// memPool is a PoolSource holding one pool's blocks in a map: enough to
// test the control channel's pool ops without a store.
type memPool struct {
	oneObject
	mu     sync.Mutex
	name   string
	shape  PoolShape
	blocks map[string][]byte
	// staged is what GatherPool exposes instead of answering inline
	// (tests of the answer's shape only: nothing fetches it).
	staged bool
}

func (m *memPool) check(c PoolCall) error {
	if c.Pool != m.name {
		return fmt.Errorf("no pool %s here: %w", c.Pool, ErrNotFound)
	}
	if c.Shape.BlockBytes != m.shape.BlockBytes {
		return fmt.Errorf("blocks of %d bytes, the pool's are %d", c.Shape.BlockBytes, m.shape.BlockBytes)
	}
	return nil
}

func (m *memPool) LookupPool(c PoolCall) (int, error) {
	if err := m.check(c); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range c.Count() {
		if m.blocks[string(c.Keys[i*c.KeyBytes:(i+1)*c.KeyBytes])] == nil {
			return i, nil
		}
	}
	return c.Count(), nil
}

func (m *memPool) PresentPool(c PoolCall) ([]bool, error) {
	if err := m.check(c); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]bool, c.Count())
	for i := range out {
		out[i] = m.blocks[string(c.Keys[i*c.KeyBytes:(i+1)*c.KeyBytes])] != nil
	}
	return out, nil
}

func (m *memPool) GatherPool(c PoolCall, max int64) ([]bool, []byte, SpaceExposure, func(), error) {
	if err := m.check(c); err != nil {
		return nil, nil, SpaceExposure{}, nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	found := make([]bool, c.Count())
	var out []byte
	for i := range found {
		if b := m.blocks[string(c.Keys[i*c.KeyBytes:(i+1)*c.KeyBytes])]; b != nil {
			found[i] = true
			out = append(out, b...)
		}
	}
	if m.staged && len(out) > 0 {
		return found, nil, SpaceExposure{Worker: []byte("w"), Regions: []SpaceRegion{{RKey: []byte("k"), Addr: 0x1000, Size: int64(len(out))}}}, func() {}, nil
	}
	if int64(len(out)) > max {
		return nil, nil, SpaceExposure{}, nil, errors.New("too large for the test")
	}
	return found, out, SpaceExposure{}, nil, nil
}

func (m *memPool) StorePool(ctx context.Context, c PoolCall, b PoolBlocks) ([]byte, error) {
	if c.Pool != m.name {
		return nil, fmt.Errorf("no pool %s here: %w", c.Pool, ErrNotFound)
	}
	if b.Staged != nil {
		return nil, errors.New("staged puts are not for this test")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	st := make([]byte, c.Count())
	bb := c.Shape.BlockBytes
	for i := range st {
		k := string(c.Keys[i*c.KeyBytes : (i+1)*c.KeyBytes])
		if m.blocks[k] != nil {
			st[i] = protocol.BlockExisted
			continue
		}
		m.blocks[k] = bytes.Clone(b.Inline[int64(i)*bb : int64(i+1)*bb])
	}
	return st, nil
}

func (m *memPool) DeletePool(c PoolCall) (int, error) {
	if err := m.check(c); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for i := range c.Count() {
		k := string(c.Keys[i*c.KeyBytes : (i+1)*c.KeyBytes])
		if m.blocks[k] != nil {
			delete(m.blocks, k)
			n++
		}
	}
	return n, nil
}

func poolKeys(r *rand.Rand, n, size int) []byte {
	b := make([]byte, n*size)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestControlPoolOps: lookups, inline puts and gets, deletes and refusals
// of a pool over a real control channel, every byte checked, the channel
// in step after each.
func TestControlPoolOps(t *testing.T) {
	const bb, kb = 100, 24
	mp := &memPool{oneObject: oneObject{Ref{Owner: 1, Name: "x"}, NewID()}, name: "1000:pool", shape: PoolShape{BlockBytes: bb, Capacity: 1 << 20}, blocks: map[string][]byte{}}
	ctx, cc := dialServed(t, mp)
	r := rand.New(rand.NewPCG(3, 4))
	keys := poolKeys(r, 40, kb)
	data := make([]byte, 40*bb)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	call := func(i, j int) *PoolCall {
		return &PoolCall{Reader: 1000, Pool: "1000:pool", KeyBytes: kb, Keys: keys[i*kb : j*kb], Shape: mp.shape}
	}
	// Put the first 30 blocks: 10 then 30 (the first 10 exist).
	for _, n := range []int{10, 30} {
		c := call(0, n)
		resp, _, err := cc.pool(ctx, c, c.request("poolput", 0), data[:n*bb])
		if err != nil {
			t.Fatal(err)
		}
		for i, s := range resp.Status {
			if want := byte(protocol.BlockStored); n == 30 && i < 10 && s != protocol.BlockExisted || (n == 10 || i >= 10) && s != want {
				t.Fatalf("put of %d: key %d status %d", n, i, s)
			}
		}
	}
	c := call(0, 40)
	resp, _, err := cc.pool(ctx, c, c.request("poollookup", 0), nil)
	if err != nil || resp.Found != 30 {
		t.Fatalf("lookup: %d found, %v; want 30", resp.Found, err)
	}
	// Which of keys 20..40 are present, each on its own: 20..30.
	c = call(20, 40)
	resp, _, err = cc.pool(ctx, c, c.request("poolpresent", 0), nil)
	if err != nil || !slices.Equal(unmask(resp.Mask, 20), append(slices.Repeat([]bool{true}, 10), make([]bool, 10)...)) {
		t.Fatalf("present: %x, %v", resp.Mask, err)
	}
	// A get of keys 25..40: 25..30 found, their blocks inline.
	c = call(25, 40)
	resp, in, err := cc.pool(ctx, c, c.request("poolget", 0), nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Mask[0] != 0x1f || resp.Mask[1] != 0 || !bytes.Equal(in, data[25*bb:30*bb]) {
		t.Fatalf("get: mask %x, %d bytes (want the 5 blocks of keys 25..30)", resp.Mask, len(in))
	}
	c = call(0, 5)
	if resp, _, err := cc.pool(ctx, c, c.request("pooldelete", 0), nil); err != nil || resp.Deleted != 5 {
		t.Fatalf("delete: %d, %v", resp.Deleted, err)
	}
	c = call(0, 40)
	if resp, _, err := cc.pool(ctx, c, c.request("poollookup", 0), nil); err != nil || resp.Found != 0 {
		t.Fatalf("lookup after the delete: %d, %v", resp.Found, err)
	}
	// Refusals: no such pool (NotHeld: ErrNotFound), another shape.
	c = call(0, 3)
	c.Pool = "1000:other"
	if _, _, err := cc.pool(ctx, c, c.request("poollookup", 0), nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("lookup of another pool: %v", err)
	}
	c = call(0, 3)
	c.Shape.BlockBytes = 99
	if _, _, err := cc.pool(ctx, c, c.request("poolget", 0), nil); !errors.Is(err, ErrPoolRefused) || errors.Is(err, ErrNotFound) {
		t.Fatalf("get of another shape: %v", err)
	}
	// A staged answer names its exposure; the channel stays in step.
	mp.staged = true
	c = call(10, 20)
	resp, in, err = cc.pool(ctx, c, c.request("poolget", 0), nil)
	if err != nil || resp.Handle == 0 || len(in) != 0 || resp.Regions[0].Size != 10*bb {
		t.Fatalf("staged get: %+v, %d bytes inline, %v", resp, len(in), err)
	}
	if err := cc.Release(ctx, resp.Handle); err != nil {
		t.Fatal(err)
	}
	// A put of blocks not of the shape's size is refused by the server.
	c = call(0, 2)
	if _, _, err := cc.pool(ctx, c, c.request("poolput", 0), data[:bb]); !errors.Is(err, ErrPoolRefused) {
		t.Fatalf("put of short blocks: %v", err)
	}
	if _, _, err := cc.Open(ctx, mp.ref, mp.id); err != nil {
		t.Fatalf("the channel after pool ops: %v", err)
	}
}

// TestControlPoolFrameMismatch: a request whose frame after it is not
// the length it announced is a peer out of step: the server drops the
// connection.
func TestControlPoolFrameMismatch(t *testing.T) {
	mp := &memPool{name: "1000:pool", shape: PoolShape{BlockBytes: 8, Capacity: 1 << 20}, blocks: map[string][]byte{}}
	ctx, cc := dialServed(t, mp)
	c := &PoolCall{Reader: 1000, Pool: "1000:pool", KeyBytes: 16, Keys: make([]byte, 32), Shape: mp.shape}
	req := c.request("poollookup", 0)
	req.Inline = 33
	if _, err := cc.exchangeRaw(ctx, req, c.Keys, nil); !errors.Is(err, errChannel) {
		t.Fatalf("a frame shorter than announced: %v", err)
	}
}

func poolSeeds() [][2][]byte {
	shape := &PoolShape{BlockBytes: 64, Capacity: 4096}
	keys := make([]byte, 3*16)
	put, _ := json.Marshal(ctlRequest{Op: "poolput", Reader: 7, Pool: "7:p", KeyBytes: 16, Count: 3, Shape: shape, Inline: int64(len(keys) + 3*64)})
	get, _ := json.Marshal(ctlRequest{Op: "poolget", Pool: "7:p", KeyBytes: 16, Count: 3, Shape: shape, Inline: int64(len(keys))})
	staged, _ := json.Marshal(ctlRequest{Op: "poolput", Pool: "7:p", KeyBytes: 16, Count: 3, Shape: shape,
		Staged: &PoolStaged{Worker: []byte("w"), Region: SpaceRegion{RKey: []byte("k"), Addr: 1, Size: 192}}, Inline: int64(len(keys))})
	return [][2][]byte{{put, append(bytes.Clone(keys), make([]byte, 192)...)}, {get, keys}, {staged, keys}, {[]byte(`{"op":"poollookup"}`), nil}}
}

// FuzzPoolCall feeds the server's decoder of pool requests arbitrary
// requests and frames: it refuses with ErrBadRecord or returns a call
// within every bound.
func FuzzPoolCall(f *testing.F) {
	for _, s := range poolSeeds() {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, js, raw []byte) {
		var req ctlRequest
		if decodeStrict(js, &req) != nil {
			return
		}
		c, blocks, err := decodePoolCall(req, raw)
		if err != nil {
			if !errors.Is(err, ErrBadRecord) {
				t.Fatalf("error does not wrap ErrBadRecord: %v", err)
			}
			return
		}
		n := c.Count()
		switch {
		case n < 1 || n > MaxPoolCallKeys || len(c.Keys) != n*c.KeyBytes || c.KeyBytes < protocol.MinKeyBytes || c.KeyBytes > protocol.MaxKeyBytes:
			t.Fatalf("accepted %d keys of %d bytes (%d bytes)", n, c.KeyBytes, len(c.Keys))
		case c.Shape.BlockBytes < 1 || c.Shape.BlockBytes > protocol.MaxBlockBytes:
			t.Fatalf("accepted blocks of %d bytes", c.Shape.BlockBytes)
		case blocks != nil && (int64(len(blocks)) != int64(n)*c.Shape.BlockBytes || len(blocks) > MaxInline):
			t.Fatalf("accepted %d bytes of inline blocks for %d blocks of %d", len(blocks), n, c.Shape.BlockBytes)
		case req.Op == "poolput" && blocks == nil && (req.Staged == nil || req.Staged.Region.Size != int64(n)*c.Shape.BlockBytes):
			t.Fatal("accepted a put with no blocks")
		}
	})
}

// FuzzPoolAnswer feeds the client's check of pool answers arbitrary
// answers: it refuses with ErrBadRecord or accepts one within the call's
// bounds (the get's blocks where its mask says).
func FuzzPoolAnswer(f *testing.F) {
	ok, _ := json.Marshal(ctlResponse{Found: 2, Status: []byte{0, 1, 2}, Mask: []byte{5}, Deleted: 1})
	f.Add(ok, []byte{}, uint8(3))
	staged, _ := json.Marshal(ctlResponse{Handle: 4, Mask: []byte{3}, Exposure: Exposure{Worker: []byte("w")}, Regions: []SpaceRegion{{RKey: []byte("k"), Addr: 1, Size: 20}}})
	f.Add(staged, []byte{}, uint8(2))
	f.Fuzz(func(t *testing.T, js, raw []byte, count uint8) {
		var resp ctlResponse
		if decodeStrict(js, &resp) != nil || count == 0 {
			return
		}
		c := &PoolCall{KeyBytes: 16, Keys: make([]byte, 16*int(count)), Shape: PoolShape{BlockBytes: 10, Capacity: 100}}
		for _, op := range []string{"poollookup", "poolpresent", "poolget", "poolput", "pooldelete"} {
			if err := checkPoolAnswer(op, c, &resp, raw); err != nil {
				if !errors.Is(err, ErrBadRecord) {
					t.Fatalf("%s: error does not wrap ErrBadRecord: %v", op, err)
				}
				continue
			}
			switch op {
			case "poolpresent":
				if len(resp.Mask) != (int(count)+7)/8 {
					t.Fatalf("accepted a mask of %d bytes for %d keys", len(resp.Mask), count)
				}
			case "poolget":
				found := 0
				for i := range int(count) {
					found += int(resp.Mask[i/8] >> (i % 8) & 1)
				}
				if len(resp.Regions) == 0 && len(raw) != found*10 || len(resp.Regions) == 1 && resp.Regions[0].Size != int64(found)*10 {
					t.Fatalf("accepted %d blocks with %d bytes inline and %d regions", found, len(raw), len(resp.Regions))
				}
			case "poolput":
				if len(resp.Status) != int(count) {
					t.Fatalf("accepted %d statuses for %d keys", len(resp.Status), count)
				}
			}
		}
	})
}
