package client

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// KV block pools (docs/kv.md, "Block pools"; docs/protocol.md section
// 6.10): the wire calls. Package kv builds the engine-facing API on them
// (kv.Pool: puts from a KV space, gets into one with per-layer
// completion).

// PoolConfig says what a pool is made of.
type PoolConfig struct {
	// BlockBytes is the size of one block: 1 to protocol.MaxBlockBytes.
	BlockBytes int64
	// KeyBytes is the size of one key: protocol.MinKeyBytes to
	// MaxKeyBytes.
	KeyBytes int
	// Capacity is the pool's memory in bytes, charged to the uid's quota
	// when it is made: at least one block (BlockBytes rounded up to
	// protocol.BlockSlotAlign).
	Capacity int64
	// Device is "" or "host" (the only tier built).
	Device string
	// Shared lets every uid the daemon admits look blocks up and get them.
	Shared bool
	// Cluster makes the pool cluster-wide (a daemon of a cluster only):
	// its keys are placed on the cluster's live nodes, each holding a pool
	// of this name, and the same calls reach them through this daemon
	// (docs/kv.md, "Across the cluster"). Each node's engine makes it; a
	// node that has it already, of the same block and key sizes and
	// sharing, answers as though it made it.
	Cluster bool
}

// PoolInfo describes a pool: its shape, its counts now and its counters
// since it was made.
type PoolInfo struct {
	// Name is bare for this uid's pools, UID:NAME for another's.
	Name     string `json:"name"`
	OwnerUID uint32 `json:"owner_uid"`
	Shared   bool   `json:"shared"`
	Device   string `json:"device"`
	// Cluster: the pool is cluster-wide; its counts and counters are
	// this node's.
	Cluster bool `json:"cluster,omitempty"`
	// ID is this incarnation of the name.
	ID         uint64 `json:"id"`
	BlockBytes int64  `json:"block_bytes"`
	KeyBytes   int    `json:"key_bytes"`
	// SlotBytes is the distance between blocks in the pool's memory:
	// block slot s lies at s*SlotBytes.
	SlotBytes      int64 `json:"slot_bytes"`
	CapacityBlocks int   `json:"capacity_blocks"`
	MemorySize     int64 `json:"memory_size"`
	// Blocks readable now, being written, and pinned.
	Blocks  int `json:"blocks"`
	Writing int `json:"writing"`
	Pinned  int `json:"pinned"`
	// Hits and Misses count the keys lookups and gets found and did not;
	// Stored the blocks puts stored; Evictions the blocks evicted.
	Hits      uint64    `json:"hits"`
	Misses    uint64    `json:"misses"`
	Stored    uint64    `json:"stored"`
	Evictions uint64    `json:"evictions"`
	Created   time.Time `json:"created"`
}

func poolInfoFromProto(p *storev1.PoolInfo) PoolInfo {
	return PoolInfo{
		Name: p.GetName(), OwnerUID: p.GetOwnerUid(), Shared: p.GetShared(), Device: p.GetDevice(), ID: p.GetId(),
		BlockBytes: int64(p.GetBlockBytes()), KeyBytes: int(p.GetKeyBytes()), SlotBytes: int64(p.GetSlotBytes()),
		CapacityBlocks: int(p.GetCapacityBlocks()), MemorySize: int64(p.GetMemorySize()),
		Blocks: int(p.GetBlocks()), Writing: int(p.GetWriting()), Pinned: int(p.GetPinned()),
		Hits: p.GetHits(), Misses: p.GetMisses(), Stored: p.GetStored(), Evictions: p.GetEvictions(),
		Created: time.Unix(0, p.GetCreatedUnixNano()), Cluster: p.GetCluster(),
	}
}

// CreatePool makes the pool name. Errors: ErrExists (a pool of that name),
// ErrStoreFull and ErrLimit (no room for its capacity, as for a create),
// ErrInvalid.
func (c *Client) CreatePool(ctx context.Context, name string, cfg PoolConfig) (PoolInfo, error) {
	if err := checkName("pool_create", name); err != nil {
		return PoolInfo{}, err
	}
	if cfg.BlockBytes <= 0 || cfg.KeyBytes <= 0 || cfg.Capacity <= 0 {
		return PoolInfo{}, &Error{Op: "pool_create", Name: name, Err: ErrInvalid,
			Message: fmt.Sprintf("blocks of %d bytes, keys of %d bytes, capacity %d: want all positive", cfg.BlockBytes, cfg.KeyBytes, cfg.Capacity)}
	}
	r, err := c.roundTrip(ctx, "pool_create", name, &storev1.Request{Body: &storev1.Request_PoolCreate{PoolCreate: &storev1.PoolCreateRequest{
		Name: name, BlockBytes: uint64(cfg.BlockBytes), KeyBytes: uint32(cfg.KeyBytes), Capacity: uint64(cfg.Capacity),
		Device: cfg.Device, Shared: cfg.Shared, Cluster: cfg.Cluster}}})
	if err != nil {
		return PoolInfo{}, err
	}
	return poolInfoFromProto(r.resp.GetPoolCreate().GetInfo()), nil
}

// DeletePool removes the pool name (its owner's uid or root). Readers that
// mapped it keep their mappings.
func (c *Client) DeletePool(ctx context.Context, name string) error {
	if err := checkName("pool_delete", name); err != nil {
		return err
	}
	_, err := c.roundTrip(ctx, "pool_delete", name, &storev1.Request{Body: &storev1.Request_PoolDelete{PoolDelete: &storev1.PoolDeleteRequest{Name: name}}})
	return err
}

// StatPool describes the pool name.
func (c *Client) StatPool(ctx context.Context, name string) (PoolInfo, error) {
	if err := checkName("pool_stat", name); err != nil {
		return PoolInfo{}, err
	}
	r, err := c.roundTrip(ctx, "pool_stat", name, &storev1.Request{Body: &storev1.Request_PoolStat{PoolStat: &storev1.PoolStatRequest{Name: name}}})
	if err != nil {
		return PoolInfo{}, err
	}
	closeFiles(r.files)
	return poolInfoFromProto(r.resp.GetPoolStat().GetInfo()), nil
}

// ListPools lists the pools this uid may read, by qualified name.
func (c *Client) ListPools(ctx context.Context) ([]PoolInfo, error) {
	var out []PoolInfo
	after := ""
	for {
		r, err := c.roundTrip(ctx, "pool_list", "", &storev1.Request{Body: &storev1.Request_PoolList{PoolList: &storev1.PoolListRequest{StartAfter: after}}})
		if err != nil {
			return nil, err
		}
		l := r.resp.GetPoolList()
		for _, p := range l.GetPools() {
			out = append(out, poolInfoFromProto(p))
		}
		if !l.GetMore() || len(l.GetPools()) == 0 {
			return out, nil
		}
		after = out[len(out)-1].Name
	}
}

// PoolMemory is a read-only mapping of a pool's memory, for copying
// blocks out of it after GetBlocks. It stays valid after the pool is
// deleted, until Close.
type PoolMemory struct {
	Info PoolInfo
	mem  []byte
}

// MapPool maps the memory of the pool name read-only.
func (c *Client) MapPool(ctx context.Context, name string) (*PoolMemory, error) {
	if err := checkName("pool_stat", name); err != nil {
		return nil, err
	}
	r, err := c.roundTrip(ctx, "pool_stat", name, &storev1.Request{Body: &storev1.Request_PoolStat{PoolStat: &storev1.PoolStatRequest{Name: name, Map: true}}})
	if err != nil {
		return nil, err
	}
	defer closeFiles(r.files)
	info := poolInfoFromProto(r.resp.GetPoolStat().GetInfo())
	if len(r.files) != 1 {
		return nil, &Error{Op: "pool_stat", Name: name, Err: ErrInternal, Message: "the daemon sent no memory for the pool"}
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(r.files[0].Fd()), &st); err != nil || st.Size < info.MemorySize {
		return nil, &Error{Op: "pool_stat", Name: name, Err: ErrInternal, Message: fmt.Sprintf("the pool's memory is smaller than the %d bytes it says (%v)", info.MemorySize, err)}
	}
	mem, err := unix.Mmap(int(r.files[0].Fd()), 0, int(info.MemorySize), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, &Error{Op: "pool_stat", Name: name, Err: ErrInternal, Message: fmt.Sprintf("mapping the pool's memory: %v", err)}
	}
	return &PoolMemory{Info: info, mem: mem}, nil
}

// Bytes returns the pool's memory; it must not be used after Close.
func (m *PoolMemory) Bytes() []byte { return m.mem }

// Block returns block slot s's BlockBytes bytes.
func (m *PoolMemory) Block(s uint32) []byte {
	off := int64(s) * m.Info.SlotBytes
	return m.mem[off : off+m.Info.BlockBytes]
}

// Close unmaps the memory. It is idempotent.
func (m *PoolMemory) Close() error {
	if m.mem == nil {
		return nil
	}
	err := unix.Munmap(m.mem)
	m.mem = nil
	return err
}

// BlockPart is where one piece of every block of a put lies in the
// source: for block id b, the Bytes bytes at Base + b*Stride of
// BlockSource.Regions[Region]. A pool block is its parts end to end.
type BlockPart struct {
	Region              int
	Base, Stride, Bytes int64
}

// BlockSource is what PutBlocks copies from: registered host memory this
// uid may read (a KV space's regions), its parts, and one block id per key.
type BlockSource struct {
	Regions []string
	Parts   []BlockPart
	Blocks  []uint32
	// Space, when set, is the space description every region must have
	// been registered with: a region registered again since is ErrNotFound.
	Space []byte
}

// PutResult is what a put did: Status[i] is key i's (protocol.BlockStored,
// BlockExisted, BlockFull, or for a cluster-wide pool BlockUnavailable:
// the node owning the key did not answer).
type PutResult struct {
	Stored, Existed, Full, Unavailable int
	Status                             []byte
}

// BlockPutOptions are a block put's options.
type BlockPutOptions struct {
	// Timeout is how long, in a cluster-wide pool, the nodes owning keys
	// have to store them: 0 means protocol.DefaultPoolTimeoutMs.
	Timeout time.Duration
}

// poolTimeoutMs checks a cluster-wide pool's timeout and returns it in
// milliseconds (0: the daemon's default).
func poolTimeoutMs(op, pool string, d time.Duration) (int64, error) {
	ms := d.Milliseconds()
	if d < 0 || ms > protocol.MaxPoolTimeoutMs || d > 0 && ms == 0 {
		return 0, &Error{Op: op, Name: pool, Err: ErrInvalid, Message: fmt.Sprintf("timeout %v: want 1ms to %dms", d, protocol.MaxPoolTimeoutMs)}
	}
	return ms, nil
}

// PutBlocks stores the blocks of keys, copied by the daemon from src (key
// i's from src.Blocks[i]), in one round trip whatever their number: a key
// present already is left as it is (BlockExisted), and one that finds no
// block free or evictable is not stored (BlockFull). Only the pool's
// owner's uid and root put.
func (c *Client) PutBlocks(ctx context.Context, pool string, keys [][]byte, src BlockSource, opts BlockPutOptions) (PutResult, error) {
	const op = "block_put"
	timeoutMs, err := poolTimeoutMs(op, pool, opts.Timeout)
	if err != nil {
		return PutResult{}, err
	}
	if len(src.Blocks) != len(keys) {
		return PutResult{}, &Error{Op: op, Name: pool, Err: ErrInvalid, Message: fmt.Sprintf("%d keys and %d source blocks: want one block a key", len(keys), len(src.Blocks))}
	}
	s := &storev1.BlockSource{Regions: src.Regions, Space: src.Space}
	for _, p := range src.Parts {
		if p.Region < 0 || p.Base < 0 || p.Stride < 0 || p.Bytes <= 0 {
			return PutResult{}, &Error{Op: op, Name: pool, Err: ErrInvalid, Message: fmt.Sprintf("part %+v: want a region index, base, stride and bytes not negative (bytes > 0)", p)}
		}
		s.Parts = append(s.Parts, &storev1.BlockPart{Region: uint32(p.Region), Base: uint64(p.Base), Stride: uint64(p.Stride), Bytes: uint64(p.Bytes)})
	}
	// The source's regions and parts travel inline: the arrays go to a
	// bulk file sooner.
	b, err := c.blockArrays(op, pool, keys, proto.Size(s))
	if err != nil {
		return PutResult{}, err
	}
	ids := b.array(4 * len(keys))
	for i, id := range src.Blocks {
		binary.LittleEndian.PutUint32(ids.buf[4*i:], id)
	}
	s.Ids = ids.blob
	statusAt := b.reserve(len(keys))
	r, err := b.roundTrip(ctx, &storev1.Request{Body: &storev1.Request_BlockPut{BlockPut: &storev1.BlockPutRequest{
		Pool: pool, Count: uint32(len(keys)), Keys: b.keys, Source: s, StatusAt: statusAt, TimeoutMs: timeoutMs}}})
	if err != nil {
		return PutResult{}, err
	}
	defer b.done(true)
	p := r.resp.GetBlockPut()
	st, err := b.read(p.GetStatus(), len(keys))
	if err != nil {
		return PutResult{}, err
	}
	return PutResult{Stored: int(p.GetStored()), Existed: int(p.GetExisted()), Full: int(p.GetFull()), Unavailable: int(p.GetUnavailable()), Status: st}, nil
}

// LookupOptions are a lookup's options.
type LookupOptions struct {
	// Pin keeps the blocks of the prefix found from eviction until a
	// GetBlocks takes the pin over, UnpinBlocks, PinTimeout, or the end of
	// the connection.
	Pin bool
	// PinTimeout is the pin's timeout: 0 means
	// protocol.DefaultPinTimeoutMs.
	PinTimeout time.Duration
	// Timeout is how long, in a cluster-wide pool, the nodes owning keys
	// have to answer: 0 means protocol.DefaultPoolLookupTimeoutMs. A node
	// that does not answer in time ends the prefix at its first key. With
	// Pin, the prefix's blocks held on other nodes are copied into this
	// daemon's pool and pinned there, within Timeout again (0:
	// protocol.DefaultPoolTimeoutMs).
	Timeout time.Duration
}

// LookupBlocks returns how many keys, from the first, the pool holds (the
// first absent key ends the prefix), in one round trip whatever their
// number, and with opts.Pin the pin that holds them (0 when none was
// found).
func (c *Client) LookupBlocks(ctx context.Context, pool string, keys [][]byte, opts LookupOptions) (found int, pin uint64, err error) {
	p, err := c.lookup(ctx, pool, keys, opts, false)
	return p.Found, p.Pin, err
}

// Presence is a per-key lookup's answer: which keys the pool holds.
type Presence struct {
	// Found is the length of the present prefix, as LookupBlocks counts
	// it; Count the keys present, in the prefix or not.
	Found, Count int
	// Pin holds every key present, with LookupOptions.Pin (0 when none
	// was).
	Pin uint64
	// Bits has bit i%8 (least significant first) of Bits[i/8] set when
	// key i is present.
	Bits []byte
}

// Has reports whether key i is present.
func (p Presence) Has(i int) bool { return p.Bits[i>>3]&(1<<(i&7)) != 0 }

// LookupPresent says which of keys the pool holds, each on its own
// (keys that are not a chain: Mooncake's batch_is_exist), in one round
// trip whatever their number. With opts.Pin every key present is pinned
// under the answer's Pin, which a GetBlocks of any of them may take over.
func (c *Client) LookupPresent(ctx context.Context, pool string, keys [][]byte, opts LookupOptions) (Presence, error) {
	return c.lookup(ctx, pool, keys, opts, true)
}

// lookup sends a block_lookup, asking for the answer's bitmap with perKey.
func (c *Client) lookup(ctx context.Context, pool string, keys [][]byte, opts LookupOptions, perKey bool) (Presence, error) {
	const op = "block_lookup"
	ms := opts.PinTimeout.Milliseconds()
	if opts.PinTimeout < 0 || ms > protocol.MaxPinTimeoutMs || opts.PinTimeout > 0 && ms == 0 {
		return Presence{}, &Error{Op: op, Name: pool, Err: ErrInvalid, Message: fmt.Sprintf("pin timeout %v: want 1ms to %dms", opts.PinTimeout, protocol.MaxPinTimeoutMs)}
	}
	timeoutMs, err := poolTimeoutMs(op, pool, opts.Timeout)
	if err != nil {
		return Presence{}, err
	}
	b, err := c.blockArrays(op, pool, keys, 0)
	if err != nil {
		return Presence{}, err
	}
	var at uint64
	if perKey {
		at = b.reserve((len(keys) + 7) / 8)
	}
	r, err := b.roundTrip(ctx, &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{
		Pool: pool, Count: uint32(len(keys)), Keys: b.keys, Pin: opts.Pin, PinTimeoutMs: ms, PerKey: perKey, PresentAt: at, TimeoutMs: timeoutMs}}})
	if err != nil {
		return Presence{}, err
	}
	defer b.done(true)
	l := r.resp.GetBlockLookup()
	p := Presence{Found: int(l.GetFound()), Pin: l.GetPin()}
	if !perKey {
		return p, nil
	}
	p.Count = int(l.GetPresentCount())
	if p.Bits, err = b.read(l.GetPresent(), (len(keys)+7)/8); err != nil {
		if p.Pin != 0 {
			go func() { _ = c.sendDetached(unpinRequest(p.Pin)) }()
		}
		return Presence{}, err
	}
	return p, nil
}

// BlockLease is a get's answer: Slots[i] is key i's block slot in the
// pool's memory (protocol.NoSlot for a key absent), held by Pin until
// UnpinBlocks (0 when none was found). In a cluster-wide pool, Unavailable
// of the keys absent are so because the node owning them did not answer,
// for the reason Reason says.
type BlockLease struct {
	Pin         uint64
	Found       int
	PoolID      uint64
	Slots       []uint32
	Unavailable int
	Reason      string
}

// BlockGetOptions are a block get's options.
type BlockGetOptions struct {
	// Pin, when not 0, is a pin of this connection's lookup that the get
	// takes over.
	Pin uint64
	// Timeout is how long, in a cluster-wide pool, the nodes owning keys
	// have to send their blocks: 0 means protocol.DefaultPoolTimeoutMs.
	Timeout time.Duration
}

// GetBlocks finds and pins the blocks of keys, in one round trip whatever
// their number: copy them out of the pool's memory (MapPool), then
// UnpinBlocks. In a cluster-wide pool the daemon first copies the blocks
// held on other nodes into its own pool.
func (c *Client) GetBlocks(ctx context.Context, pool string, keys [][]byte, opts BlockGetOptions) (BlockLease, error) {
	const op = "block_get"
	timeoutMs, err := poolTimeoutMs(op, pool, opts.Timeout)
	if err != nil {
		return BlockLease{}, err
	}
	b, err := c.blockArrays(op, pool, keys, 0)
	if err != nil {
		return BlockLease{}, err
	}
	slotsAt := b.reserve(4 * len(keys))
	r, err := b.roundTrip(ctx, &storev1.Request{Body: &storev1.Request_BlockGet{BlockGet: &storev1.BlockGetRequest{
		Pool: pool, Count: uint32(len(keys)), Keys: b.keys, Pin: opts.Pin, SlotsAt: slotsAt, TimeoutMs: timeoutMs}}})
	if err != nil {
		return BlockLease{}, err
	}
	defer b.done(true)
	g := r.resp.GetBlockGet()
	raw, err := b.read(g.GetSlots(), 4*len(keys))
	if err != nil {
		if g.GetPin() != 0 {
			go func() { _ = c.sendDetached(unpinRequest(g.GetPin())) }()
		}
		return BlockLease{}, err
	}
	l := BlockLease{Pin: g.GetPin(), Found: int(g.GetFound()), PoolID: g.GetPoolId(), Slots: make([]uint32, len(keys)),
		Unavailable: int(g.GetUnavailable()), Reason: g.GetUnavailableReason()}
	for i := range l.Slots {
		l.Slots[i] = binary.LittleEndian.Uint32(raw[4*i:])
	}
	return l, nil
}

func unpinRequest(pin uint64) *storev1.Request {
	return &storev1.Request{Body: &storev1.Request_BlockUnpin{BlockUnpin: &storev1.BlockUnpinRequest{Pin: pin}}}
}

// UnpinBlocks ends a pin of this connection (a lookup's or a get's).
func (c *Client) UnpinBlocks(ctx context.Context, pin uint64) error {
	_, err := c.roundTrip(ctx, "block_unpin", "", unpinRequest(pin))
	return err
}

// UnpinBlocksAsync ends a pin of this connection without waiting for
// the daemon's answer: the daemon handles a connection's requests in the
// order they come, so any request this client sends afterwards finds the
// blocks unpinned. A pin unknown to the daemon goes unnoticed.
func (c *Client) UnpinBlocksAsync(pin uint64) error {
	return c.sendDetached(unpinRequest(pin))
}

// DeleteBlocks removes keys from the pool (its owner's uid or root) and
// returns how many it held.
func (c *Client) DeleteBlocks(ctx context.Context, pool string, keys [][]byte) (int, error) {
	b, err := c.blockArrays("block_delete", pool, keys, 0)
	if err != nil {
		return 0, err
	}
	r, err := b.roundTrip(ctx, &storev1.Request{Body: &storev1.Request_BlockDelete{BlockDelete: &storev1.BlockDeleteRequest{
		Pool: pool, Count: uint32(len(keys)), Keys: b.keys}}})
	if err != nil {
		return 0, err
	}
	b.done(true)
	return int(r.resp.GetBlockDelete().GetDeleted()), nil
}

// EvictBlocks evicts up to n least recently used blocks of the pool that
// are neither pinned nor being written (its owner's uid or root), and
// returns how many it evicted.
func (c *Client) EvictBlocks(ctx context.Context, pool string, n int) (int, error) {
	if err := checkName("block_evict", pool); err != nil {
		return 0, err
	}
	if n <= 0 || n > 1<<32-1 {
		return 0, &Error{Op: "block_evict", Name: pool, Err: ErrInvalid, Message: fmt.Sprintf("%d blocks: want 1 to 2^32-1", n)}
	}
	r, err := c.roundTrip(ctx, "block_evict", pool, &storev1.Request{Body: &storev1.Request_BlockEvict{BlockEvict: &storev1.BlockEvictRequest{Pool: pool, Blocks: uint32(n)}}})
	if err != nil {
		return 0, err
	}
	return int(r.resp.GetBlockEvict().GetEvicted()), nil
}

// Block requests' arrays. Small requests carry them inline; a request
// whose arrays pass bulkInline bytes carries a memfd (its bulk file)
// holding them, into which the daemon writes the response's array too
// (docs/protocol.md section 6.10). The client keeps a few such memfds
// mapped for its next requests.

// bulkInline is the most bytes of arrays a request carries inline: with
// the rest of the request it stays well inside one packet.
const bulkInline = 48 << 10

// blockCall builds one block request's arrays, inline or in a bulk file.
type blockCall struct {
	c        *Client
	op, pool string
	keys     *storev1.Blob
	file     *bulkFile // nil: inline
	next     int       // the file's next free offset
	inline   int       // bytes of inline arrays so far
}

// blockArrays checks keys (all of one size, MinKeyBytes to MaxKeyBytes)
// and starts a call with them; beside is how many bytes the request
// carries inline beside its arrays.
func (c *Client) blockArrays(op, pool string, keys [][]byte, beside int) (*blockCall, error) {
	if err := checkName(op, pool); err != nil {
		return nil, err
	}
	if len(keys) == 0 || len(keys) > protocol.MaxBlockKeys {
		return nil, &Error{Op: op, Name: pool, Err: ErrInvalid, Message: fmt.Sprintf("%d keys: want 1 to %d", len(keys), protocol.MaxBlockKeys)}
	}
	k := len(keys[0])
	if k < protocol.MinKeyBytes || k > protocol.MaxKeyBytes {
		return nil, &Error{Op: op, Name: pool, Err: ErrInvalid, Message: fmt.Sprintf("keys of %d bytes: want %d to %d", k, protocol.MinKeyBytes, protocol.MaxKeyBytes)}
	}
	b := &blockCall{c: c, op: op, pool: pool}
	// Keys, ids (a put's, 4 bytes a key) and the answer's array (at most 4
	// bytes a key) decide where the arrays go.
	if len(keys)*(k+8)+beside > bulkInline {
		f, err := c.bulk.take(len(keys) * (k + 8))
		if err != nil {
			return nil, &Error{Op: op, Name: pool, Err: ErrInternal, Message: fmt.Sprintf("a bulk file for %d keys: %v", len(keys), err)}
		}
		b.file = f
	}
	a := b.array(len(keys) * k)
	for i, key := range keys {
		if len(key) != k {
			b.done(false)
			return nil, &Error{Op: op, Name: pool, Err: ErrInvalid, Message: fmt.Sprintf("key %d is %d bytes, key 0 %d: a request's keys are all of one size", i, len(key), k)}
		}
		copy(a.buf[i*k:], key)
	}
	b.keys = a.blob
	return b, nil
}

// arrayOf is one array of a request: its buffer to fill and its Blob.
type arrayOf struct {
	buf  []byte
	blob *storev1.Blob
}

// array returns a request array of n bytes to fill.
func (b *blockCall) array(n int) arrayOf {
	if b.file == nil {
		buf := make([]byte, n)
		b.inline += n
		return arrayOf{buf, &storev1.Blob{Data: buf}}
	}
	off := b.reserve(n)
	return arrayOf{b.file.mem[off : int(off)+n], &storev1.Blob{Offset: off, Length: uint64(n)}}
}

// reserve returns the offset of n bytes of the bulk file for the
// response's array (0 inline: the daemon ignores it).
func (b *blockCall) reserve(n int) uint64 {
	if b.file == nil {
		return 0
	}
	off := b.next
	b.next = (off + n + 63) &^ 63
	return uint64(off)
}

// roundTrip sends the request with its bulk file attached, if any.
func (b *blockCall) roundTrip(ctx context.Context, req *storev1.Request) (reply, error) {
	var files []*os.File
	if b.file != nil {
		files = []*os.File{b.file.f}
	}
	r, err := b.c.roundTripFiles(ctx, b.op, b.pool, req, files)
	if err != nil {
		// The daemon of a call abandoned may still write into the file:
		// it is not used again.
		b.done(false)
	}
	return r, err
}

// read returns a response's array of n bytes: inline, or from the bulk
// file where the request said.
func (b *blockCall) read(blob *storev1.Blob, n int) ([]byte, error) {
	if b.file == nil {
		if len(blob.GetData()) != n {
			return nil, &Error{Op: b.op, Name: b.pool, Err: ErrInternal, Message: fmt.Sprintf("an answer of %d bytes, want %d", len(blob.GetData()), n)}
		}
		return blob.GetData(), nil
	}
	off := blob.GetOffset()
	if blob.GetLength() != uint64(n) || off > uint64(len(b.file.mem)-n) {
		return nil, &Error{Op: b.op, Name: b.pool, Err: ErrInternal, Message: fmt.Sprintf("an answer of %d bytes at %d of a bulk file of %d, want %d", blob.GetLength(), off, len(b.file.mem), n)}
	}
	return append([]byte(nil), b.file.mem[off:off+uint64(n)]...), nil
}

// done gives the bulk file back for another call, or drops it when reuse
// is false.
func (b *blockCall) done(reuse bool) {
	if b.file == nil {
		return
	}
	f := b.file
	b.file = nil
	if reuse {
		b.c.bulk.give(f)
	} else {
		f.close()
	}
}

// bulkFile is a memfd mapped read-write: a block request's bulk file.
type bulkFile struct {
	f   *os.File
	mem []byte
}

func (f *bulkFile) close() {
	unix.Munmap(f.mem)
	f.f.Close()
}

// bulkCache keeps a few bulk files for later calls.
type bulkCache struct {
	mu     sync.Mutex
	free   []*bulkFile
	closed bool
}

// maxBulkKept bounds the bulk files a client keeps.
const maxBulkKept = 4

// take returns a bulk file of at least n bytes (with room for alignment
// padding between arrays).
func (bc *bulkCache) take(n int) (*bulkFile, error) {
	n += 3 * 64
	bc.mu.Lock()
	for i, f := range bc.free {
		if len(f.mem) >= n {
			bc.free = append(bc.free[:i], bc.free[i+1:]...)
			bc.mu.Unlock()
			return f, nil
		}
	}
	bc.mu.Unlock()
	size := max(1<<20, (n+1<<20-1)&^(1<<20-1))
	fd, err := unix.MemfdCreate("cudaipc-bulk", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "cudaipc-bulk")
	if err := f.Truncate(int64(size)); err != nil {
		f.Close()
		return nil, err
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, err
	}
	return &bulkFile{f: f, mem: mem}, nil
}

func (bc *bulkCache) give(f *bulkFile) {
	bc.mu.Lock()
	defer bc.mu.Unlock()
	if bc.closed || len(bc.free) >= maxBulkKept {
		f.close()
		return
	}
	bc.free = append(bc.free, f)
}

func (bc *bulkCache) close() {
	bc.mu.Lock()
	defer bc.mu.Unlock()
	bc.closed = true
	for _, f := range bc.free {
		f.close()
	}
	bc.free = nil
}
