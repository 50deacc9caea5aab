package protocol

import (
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Bounds of KV block pools and their requests (docs/protocol.md section
// 6.10), enforced by ValidateRequest and the daemon.
const (
	// MinKeyBytes and MaxKeyBytes bound a pool's key size: engines'
	// content hashes.
	MinKeyBytes = 16
	MaxKeyBytes = 32
	// MaxBlockBytes bounds a pool's block size.
	MaxBlockBytes = 1 << 30
	// MaxPoolBlocks bounds a pool's blocks, so that its index (about a
	// hundred bytes a block in the daemon) stays bounded.
	MaxPoolBlocks = 1 << 22
	// BlockSlotAlign is the alignment of a pool's block slots in its
	// memory: a slot is the block size rounded up to it.
	BlockSlotAlign = 256
	// MaxBlockKeys bounds the keys of one request.
	MaxBlockKeys = 1 << 18
	// MaxBlockRegions and MaxBlockParts bound a put's source, which
	// travels inline: it must also fit one packet with the request.
	MaxBlockRegions = 1024
	MaxBlockParts   = 1024
	// MaxBulkSize bounds a bulk file's spans: every array of a request of
	// MaxBlockKeys keys fits.
	MaxBulkSize = 64 << 20
	// DefaultPinTimeoutMs is a lookup's pin timeout when it gives none;
	// MaxPinTimeoutMs the longest one it may give.
	DefaultPinTimeoutMs = 30_000
	MaxPinTimeoutMs     = 600_000
	// DefaultPoolLookupTimeoutMs and DefaultPoolTimeoutMs are how long the
	// nodes owning keys of a cluster-wide pool have to answer a lookup, and
	// a put or a get, when the request gives no timeout; MaxPoolTimeoutMs
	// the longest one it may give.
	DefaultPoolLookupTimeoutMs = 1_000
	DefaultPoolTimeoutMs       = 30_000
	MaxPoolTimeoutMs           = 600_000
	// NoSlot is the slot of a key a get did not find.
	NoSlot = 0xffffffff
)

// A put's status of one key (BlockPutResponse.status).
const (
	BlockStored  = 0 // stored by this put
	BlockExisted = 1 // present already (or being written by another put)
	BlockFull    = 2 // not stored: every block is pinned or being written
	// BlockUnavailable: not stored: the node owning the key (a cluster-wide
	// pool's) did not answer.
	BlockUnavailable = 3
)

// BlockRequest reports whether r is a request of a KV block pool that may
// carry a bulk file (block_put, block_lookup, block_get, block_delete).
func BlockRequest(r *storev1.Request) bool {
	switch r.GetBody().(type) {
	case *storev1.Request_BlockPut, *storev1.Request_BlockLookup, *storev1.Request_BlockGet, *storev1.Request_BlockDelete:
		return true
	}
	return false
}

// validatePool checks the requests of KV block pools; ok is false for
// other requests.
func validatePool(r *storev1.Request, nfiles int) (ok bool, err error) {
	bulk := nfiles == 1
	switch b := r.GetBody().(type) {
	case *storev1.Request_PoolCreate:
		c := b.PoolCreate
		switch {
		case ValidateName(c.GetName()) != nil:
			return true, ValidateName(c.GetName())
		case c.GetBlockBytes() == 0 || c.GetBlockBytes() > MaxBlockBytes:
			return true, Errorf(storev1.Error_INVALID, "pool_create: blocks of %d bytes, want 1 to %d", c.GetBlockBytes(), MaxBlockBytes)
		case c.GetKeyBytes() < MinKeyBytes || c.GetKeyBytes() > MaxKeyBytes:
			return true, Errorf(storev1.Error_INVALID, "pool_create: keys of %d bytes, want %d to %d", c.GetKeyBytes(), MinKeyBytes, MaxKeyBytes)
		case c.GetCapacity() == 0 || c.GetCapacity() > MaxObjectSize:
			return true, Errorf(storev1.Error_INVALID, "pool_create: a capacity of %d bytes, want 1 to %d", c.GetCapacity(), uint64(MaxObjectSize))
		}
		return true, ValidateDevice(c.GetDevice())
	case *storev1.Request_PoolDelete:
		return true, ValidateName(b.PoolDelete.GetName())
	case *storev1.Request_PoolStat:
		return true, ValidateName(b.PoolStat.GetName())
	case *storev1.Request_PoolList:
		if s := b.PoolList.GetStartAfter(); s != "" {
			return true, ValidateName(s)
		}
		return true, nil
	case *storev1.Request_BlockPut:
		p := b.BlockPut
		if err := validatePoolTimeout("block_put", p.GetTimeoutMs()); err != nil {
			return true, err
		}
		if err := validateKeys("block_put", p.GetPool(), p.GetCount(), p.GetKeys(), bulk); err != nil {
			return true, err
		}
		return true, validateSource(p.GetSource(), p.GetCount(), bulk)
	case *storev1.Request_BlockLookup:
		l := b.BlockLookup
		if t := l.GetPinTimeoutMs(); t < 0 || t > MaxPinTimeoutMs {
			return true, Errorf(storev1.Error_INVALID, "block_lookup: pin timeout of %d ms, want 0 to %d", t, MaxPinTimeoutMs)
		}
		if err := validatePoolTimeout("block_lookup", l.GetTimeoutMs()); err != nil {
			return true, err
		}
		return true, validateKeys("block_lookup", l.GetPool(), l.GetCount(), l.GetKeys(), bulk)
	case *storev1.Request_BlockGet:
		g := b.BlockGet
		if err := validatePoolTimeout("block_get", g.GetTimeoutMs()); err != nil {
			return true, err
		}
		return true, validateKeys("block_get", g.GetPool(), g.GetCount(), g.GetKeys(), bulk)
	case *storev1.Request_BlockDelete:
		d := b.BlockDelete
		return true, validateKeys("block_delete", d.GetPool(), d.GetCount(), d.GetKeys(), bulk)
	case *storev1.Request_BlockUnpin:
		if b.BlockUnpin.GetPin() == 0 {
			return true, Errorf(storev1.Error_INVALID, "block_unpin: pin 0")
		}
		return true, nil
	case *storev1.Request_BlockEvict:
		if err := ValidateName(b.BlockEvict.GetPool()); err != nil {
			return true, err
		}
		if b.BlockEvict.GetBlocks() == 0 {
			return true, Errorf(storev1.Error_INVALID, "block_evict: 0 blocks")
		}
		return true, nil
	}
	return false, nil
}

// validatePoolTimeout checks a block request's timeout for the nodes
// owning keys of a cluster-wide pool.
func validatePoolTimeout(op string, ms int64) error {
	if ms < 0 || ms > MaxPoolTimeoutMs {
		return Errorf(storev1.Error_INVALID, "%s: a timeout of %d ms, want 0 to %d", op, ms, MaxPoolTimeoutMs)
	}
	return nil
}

// validateKeys checks a block request's pool name, key count and keys:
// inline, count keys of MinKeyBytes to MaxKeyBytes each (the pool's size
// is for the daemon to check); in the bulk file, a span.
func validateKeys(op, pool string, count uint32, keys *storev1.Blob, bulk bool) error {
	if err := ValidateName(pool); err != nil {
		return err
	}
	if count == 0 || count > MaxBlockKeys {
		return Errorf(storev1.Error_INVALID, "%s: %d keys, want 1 to %d", op, count, MaxBlockKeys)
	}
	n, err := blobLen(op+": keys", keys, bulk)
	if err != nil {
		return err
	}
	if n%uint64(count) != 0 || n/uint64(count) < MinKeyBytes || n/uint64(count) > MaxKeyBytes {
		return Errorf(storev1.Error_INVALID, "%s: %d bytes of keys for %d keys: want %d to %d bytes a key", op, n, count, MinKeyBytes, MaxKeyBytes)
	}
	return nil
}

// blobLen checks a Blob of a request and returns its length: inline
// without a bulk file, a span of at most MaxBulkSize in it with one.
func blobLen(what string, b *storev1.Blob, bulk bool) (uint64, error) {
	if !bulk {
		if b.GetOffset() != 0 || b.GetLength() != 0 {
			return 0, Errorf(storev1.Error_INVALID, "%s: a span of a bulk file, and no bulk file attached", what)
		}
		return uint64(len(b.GetData())), nil
	}
	if len(b.GetData()) != 0 {
		return 0, Errorf(storev1.Error_INVALID, "%s: inline data in a request with a bulk file (its arrays are all in the file)", what)
	}
	if b.GetLength() > MaxBulkSize || b.GetOffset() > MaxBulkSize-b.GetLength() {
		return 0, Errorf(storev1.Error_INVALID, "%s: a span [%d, +%d) past %d bytes of a bulk file", what, b.GetOffset(), b.GetLength(), MaxBulkSize)
	}
	return b.GetLength(), nil
}

// validateSource checks a put's source: regions named, parts inside the
// region list, one block id per key.
func validateSource(s *storev1.BlockSource, count uint32, bulk bool) error {
	if s == nil {
		return Errorf(storev1.Error_INVALID, "block_put: no source")
	}
	if n := len(s.GetRegions()); n == 0 || n > MaxBlockRegions {
		return Errorf(storev1.Error_INVALID, "block_put: %d source regions, want 1 to %d", n, MaxBlockRegions)
	}
	for _, name := range s.GetRegions() {
		if err := ValidateName(name); err != nil {
			return err
		}
	}
	if n := len(s.GetParts()); n == 0 || n > MaxBlockParts {
		return Errorf(storev1.Error_INVALID, "block_put: %d parts, want 1 to %d", n, MaxBlockParts)
	}
	for i, p := range s.GetParts() {
		if int(p.GetRegion()) >= len(s.GetRegions()) || p.GetBytes() == 0 || p.GetBytes() > MaxBlockBytes {
			return Errorf(storev1.Error_INVALID, "block_put: part %d: region %d of %d, %d bytes (want 1 to %d)", i, p.GetRegion(), len(s.GetRegions()), p.GetBytes(), MaxBlockBytes)
		}
	}
	if len(s.GetSpace()) > MaxSpaceSize {
		return Errorf(storev1.Error_INVALID, "block_put: a space description of %d bytes, at most %d", len(s.GetSpace()), MaxSpaceSize)
	}
	n, err := blobLen("block_put: ids", s.GetIds(), bulk)
	if err != nil {
		return err
	}
	if n != 4*uint64(count) {
		return Errorf(storev1.Error_INVALID, "block_put: %d bytes of block ids for %d keys, want 4 a key", n, count)
	}
	return nil
}

// poolKind returns the operation name of a pool request; "" for others.
func poolKind(r *storev1.Request) string {
	switch r.GetBody().(type) {
	case *storev1.Request_PoolCreate:
		return "pool_create"
	case *storev1.Request_PoolDelete:
		return "pool_delete"
	case *storev1.Request_PoolStat:
		return "pool_stat"
	case *storev1.Request_PoolList:
		return "pool_list"
	case *storev1.Request_BlockPut:
		return "block_put"
	case *storev1.Request_BlockLookup:
		return "block_lookup"
	case *storev1.Request_BlockGet:
		return "block_get"
	case *storev1.Request_BlockUnpin:
		return "block_unpin"
	case *storev1.Request_BlockDelete:
		return "block_delete"
	case *storev1.Request_BlockEvict:
		return "block_evict"
	}
	return ""
}

// validatePoolResponse checks the responses of KV block pools as a
// client should; ok is false for other responses. files is how many
// descriptors the response may carry.
func validatePoolResponse(r *storev1.Response) (files int, ok bool, err error) {
	switch b := r.GetBody().(type) {
	case *storev1.Response_PoolCreate:
		return 0, true, validatePoolInfo(b.PoolCreate.GetInfo())
	case *storev1.Response_PoolStat:
		if b.PoolStat.GetFdAttached() {
			files = 1
		}
		return files, true, validatePoolInfo(b.PoolStat.GetInfo())
	case *storev1.Response_PoolList:
		for _, p := range b.PoolList.GetPools() {
			if err := validatePoolInfo(p); err != nil {
				return 0, true, err
			}
		}
		return 0, true, nil
	case *storev1.Response_BlockGet:
		if b.BlockGet.GetPoolId() == 0 || (b.BlockGet.GetPin() == 0) != (b.BlockGet.GetFound() == 0) {
			return 0, true, invalid("block_get: no pool id, or a pin without blocks found (or blocks without a pin)")
		}
		return 0, true, nil
	case *storev1.Response_PoolDelete, *storev1.Response_BlockPut, *storev1.Response_BlockLookup,
		*storev1.Response_BlockUnpin, *storev1.Response_BlockDelete, *storev1.Response_BlockEvict:
		return 0, true, nil
	}
	return 0, false, nil
}

func validatePoolInfo(p *storev1.PoolInfo) error {
	switch {
	case p == nil:
		return invalid("missing pool info")
	case ValidateName(p.GetName()) != nil:
		return invalid("pool info: bad name")
	case p.GetBlockBytes() == 0 || p.GetBlockBytes() > MaxBlockBytes || p.GetSlotBytes() < p.GetBlockBytes():
		return invalid("pool info: bad block size")
	case p.GetKeyBytes() < MinKeyBytes || p.GetKeyBytes() > MaxKeyBytes:
		return invalid("pool info: bad key size")
	case p.GetCapacityBlocks() == 0 || p.GetCapacityBlocks() > MaxPoolBlocks || p.GetId() == 0:
		return invalid("pool info: bad capacity or id")
	case p.GetSlotBytes() > MaxBlockBytes+BlockSlotAlign || p.GetMemorySize()/p.GetSlotBytes() < p.GetCapacityBlocks():
		return invalid("pool info: memory smaller than its blocks")
	case ValidateDevice(p.GetDevice()) != nil:
		return invalid("pool info: bad device")
	}
	return nil
}
