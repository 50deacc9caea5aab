package store

import (
	"encoding/binary"
	"os"
	"runtime"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"github.com/cudaipc/cudaipc/store/internal/blocks"
)

// poolRequest serves a request of KV block pools (valid as
// protocol.ValidateRequest checks it), taking files (a block request's
// bulk file, or none), and reports whether it was one. A put, which
// copies, runs in a goroutine of its own; the others answer at once.
func (cn *conn) poolRequest(req *storev1.Request, files []*os.File) bool {
	op := protocol.RequestKind(req)
	id := req.GetId()
	var bulk *os.File
	if len(files) == 1 {
		bulk = files[0]
	}
	fail := func(err error) {
		protocol.CloseFiles(files)
		cn.reply(op, protocol.ErrorResponse(id, err), nil)
	}
	ok := func(body *storev1.Response) {
		protocol.CloseFiles(files)
		body.Id = id
		cn.reply(op, body, nil)
	}
	if bulk != nil {
		if err := checkBulk(bulk); err != nil {
			fail(err)
			return true
		}
	}
	ss := cn.ss
	// A request of a cluster-wide pool may wait for other nodes: it runs
	// in a goroutine of its own, as a put does.
	run := func(f func()) { f() }
	if cn.clusterPoolRequest(req) {
		run = func(f func()) { cn.wg.Go(f) }
	}
	switch b := req.GetBody().(type) {
	case *storev1.Request_PoolCreate:
		name, err := cn.qualify(b.PoolCreate.GetName(), true)
		if err != nil {
			fail(err)
			return true
		}
		b.PoolCreate.Name = name
		p, err := ss.createPool(b.PoolCreate)
		if err != nil {
			fail(err)
			return true
		}
		ok(&storev1.Response{Body: &storev1.Response_PoolCreate{PoolCreate: &storev1.PoolCreateResponse{Info: cn.localPool(p.info())}}})
	case *storev1.Request_PoolDelete:
		name, err := cn.qualify(b.PoolDelete.GetName(), false)
		if err == nil {
			err = ss.deletePool(name)
		}
		if err != nil {
			fail(err)
			return true
		}
		ok(&storev1.Response{Body: &storev1.Response_PoolDelete{PoolDelete: &storev1.PoolDeleteResponse{}}})
	case *storev1.Request_PoolStat:
		cn.poolStat(id, b.PoolStat)
	case *storev1.Request_PoolList:
		start := b.PoolList.GetStartAfter()
		if start != "" {
			var err error
			if start, err = cn.qualify(start, false); err != nil {
				fail(err)
				return true
			}
		}
		pools, more := ss.listPools(start)
		for _, p := range pools {
			cn.localPool(p)
		}
		ok(&storev1.Response{Body: &storev1.Response_PoolList{PoolList: &storev1.PoolListResponse{Pools: pools, More: more}}})
	case *storev1.Request_BlockPut:
		r := b.BlockPut
		cn.wg.Go(func() {
			resp, err := cn.blockPut(r, bulk)
			if err != nil {
				fail(err)
				return
			}
			ok(&storev1.Response{Body: &storev1.Response_BlockPut{BlockPut: resp}})
		})
	case *storev1.Request_BlockLookup:
		run(func() {
			resp, err := cn.blockLookup(b.BlockLookup, bulk)
			if err != nil {
				fail(err)
				return
			}
			ok(&storev1.Response{Body: &storev1.Response_BlockLookup{BlockLookup: resp}})
		})
	case *storev1.Request_BlockGet:
		run(func() {
			resp, err := cn.blockGet(b.BlockGet, bulk)
			if err != nil {
				fail(err)
				return
			}
			ok(&storev1.Response{Body: &storev1.Response_BlockGet{BlockGet: resp}})
		})
	case *storev1.Request_BlockUnpin:
		if err := ss.unpin(b.BlockUnpin.GetPin()); err != nil {
			fail(err)
			return true
		}
		ok(&storev1.Response{Body: &storev1.Response_BlockUnpin{BlockUnpin: &storev1.BlockUnpinResponse{}}})
	case *storev1.Request_BlockDelete:
		run(func() {
			n, err := cn.blockDelete(b.BlockDelete, bulk)
			if err != nil {
				fail(err)
				return
			}
			ok(&storev1.Response{Body: &storev1.Response_BlockDelete{BlockDelete: &storev1.BlockDeleteResponse{Deleted: uint32(n)}}})
		})
	case *storev1.Request_BlockEvict:
		n, err := cn.blockEvict(b.BlockEvict)
		if err != nil {
			fail(err)
			return true
		}
		ok(&storev1.Response{Body: &storev1.Response_BlockEvict{BlockEvict: &storev1.BlockEvictResponse{Evicted: uint32(n)}}})
	default:
		return false
	}
	return true
}

// localPool rewrites a pool's name as this connection addresses it.
func (cn *conn) localPool(in *storev1.PoolInfo) *storev1.PoolInfo {
	if owner, rest, ok := protocol.SplitOwner(in.Name); ok && owner == cn.ss.peer.uid {
		in.Name = rest
	}
	return in
}

// poolStat answers a pool_stat, with the pool's memory (read-only)
// attached when asked.
func (cn *conn) poolStat(id uint64, r *storev1.PoolStatRequest) {
	name, err := cn.qualify(r.GetName(), false)
	var p *blockPool
	if err == nil {
		p, err = cn.ss.poolFor(name, false)
	}
	var f *os.File
	if err == nil && r.GetMap() {
		// Entered, so that the arena is not closed under the share.
		if !p.enter() {
			err = &protocol.CodeError{Code: storev1.Error_NOT_FOUND, Message: "KV block pool " + r.GetName() + ": " + errPoolGone.Error()}
		} else {
			var sh arenaShare
			if sh, err = p.ar.share(false); err == nil {
				f = sh.file
			}
			cn.s.leavePool(p)
		}
	}
	if err != nil {
		cn.reply("pool_stat", protocol.ErrorResponse(id, err), nil)
		return
	}
	resp := &storev1.Response{Id: id, Body: &storev1.Response_PoolStat{PoolStat: &storev1.PoolStatResponse{
		Info: cn.localPool(p.info()), FdAttached: f != nil}}}
	if f == nil {
		cn.reply("pool_stat", resp, nil)
		return
	}
	defer f.Close()
	cn.order.Lock()
	defer cn.order.Unlock()
	cn.s.metrics.request("pool_stat", "ok")
	cn.sendLocked(resp, f)
}

// blockKeys resolves a block request's pool and reads its keys; done
// gives their buffer back.
func (cn *conn) blockKeys(pool string, count uint32, keys *storev1.Blob, bulk *os.File, write bool) (p *blockPool, ks blocks.Keys, done func(), err error) {
	name, err := cn.qualify(pool, false)
	if err != nil {
		return nil, ks, nil, err
	}
	if p, err = cn.ss.poolFor(name, write); err != nil {
		return nil, ks, nil, err
	}
	data, done, err := readBlob("keys", keys, bulk)
	if err != nil {
		return nil, ks, nil, err
	}
	if ks, err = p.parseKeys(data, count); err != nil {
		done()
		return nil, ks, nil, err
	}
	return p, ks, done, nil
}

// blockPut stores the blocks of a put: it maps the source regions, takes
// a slot for each absent key (blocks.Index.Reserve: invisible until
// committed), copies each key's parts into its slot and commits.
func (cn *conn) blockPut(r *storev1.BlockPutRequest, bulk *os.File) (*storev1.BlockPutResponse, error) {
	ss := cn.ss
	p, keys, done, err := cn.blockKeys(r.GetPool(), r.GetCount(), r.GetKeys(), bulk, true)
	if err != nil {
		return nil, err
	}
	defer done()
	src := r.GetSource()
	raw, doneIDs, err := readBlob("ids", src.GetIds(), bulk)
	if err != nil {
		return nil, err
	}
	defer doneIDs()
	ids := make([]uint32, keys.Len())
	maxID := uint32(0)
	for i := range ids {
		ids[i] = binary.LittleEndian.Uint32(raw[4*i:])
		maxID = max(maxID, ids[i])
	}
	names := make([]string, len(src.GetRegions()))
	for i, n := range src.GetRegions() {
		if names[i], err = cn.qualify(n, false); err != nil {
			return nil, err
		}
	}
	mems, release, err := ss.mapSources(names, src.GetSpace())
	if err != nil {
		return nil, err
	}
	defer release()
	parts, err := p.checkParts(src.GetParts(), mems, maxID)
	if err != nil {
		return nil, err
	}
	var st []byte
	if p.cluster {
		st = cn.clusterPut(p, keys, ids, parts, mems, r.GetTimeoutMs())
	} else if st, err = cn.s.putLocal(p, keys, ids, parts, mems); err != nil {
		return nil, err
	}
	resp := &storev1.BlockPutResponse{}
	for _, s := range st {
		switch s {
		case protocol.BlockStored:
			resp.Stored++
		case protocol.BlockExisted:
			resp.Existed++
		case protocol.BlockFull:
			resp.Full++
		case protocol.BlockUnavailable:
			resp.Unavailable++
		}
	}
	if resp.Status, err = writeBlob("status", st, bulk, r.GetStatusAt()); err != nil {
		return nil, err
	}
	return resp, nil
}

// putLocal stores the blocks of keys in this node's pool p, key i's from
// source block ids[i], and returns each key's status.
func (s *Store) putLocal(p *blockPool, keys blocks.Keys, ids []uint32, parts []part, mems [][]byte) ([]byte, error) {
	if !p.enter() {
		return nil, &protocol.CodeError{Code: storev1.Error_NOT_FOUND, Message: "KV block pool " + p.name + ": " + errPoolGone.Error()}
	}
	defer s.leavePool(p)
	slots := make([]int32, keys.Len())
	status := make([]blocks.Status, keys.Len())
	p.mu.Lock()
	stored, evicted := p.idx.Reserve(keys, slots, status)
	p.evictions += uint64(evicted)
	p.mu.Unlock()
	p.copyIn(slots, ids, parts, mems)
	p.mu.Lock()
	p.idx.Commit(slots)
	p.stored += uint64(stored)
	p.mu.Unlock()
	s.metrics.pools.putDone(p, stored, evicted)
	st := make([]byte, len(status))
	for i, s := range status {
		st[i] = byte(s)
	}
	return st, nil
}

// part is a checked BlockPart: where it lies in the source and in a block.
type part struct {
	region              int
	base, stride, bytes int64
	off                 int64 // offset in the pool's block
}

// checkParts checks a put's parts against the pool's block size and the
// source regions: every part of every block id up to maxID inside its
// region, without overflow.
func (p *blockPool) checkParts(in []*storev1.BlockPart, mems [][]byte, maxID uint32) ([]part, error) {
	out := make([]part, len(in))
	var off int64
	for i, bp := range in {
		size := uint64(len(mems[bp.GetRegion()]))
		base, stride, n := bp.GetBase(), bp.GetStride(), bp.GetBytes()
		// base + maxID*stride + n <= size, in steps that cannot overflow.
		if base > size || n > size-base || maxID > 0 && stride > (size-base-n)/uint64(maxID) {
			return nil, invalidf("block_put: part %d (base %d, stride %d, %d bytes) of block %d passes the end of region %d (%d bytes)",
				i, base, stride, n, maxID, bp.GetRegion(), size)
		}
		out[i] = part{region: int(bp.GetRegion()), base: int64(base), stride: int64(stride), bytes: int64(n), off: off}
		off += int64(n)
		if off > p.blockBytes {
			break
		}
	}
	if off != p.blockBytes {
		return nil, invalidf("block_put: the parts add up to %d bytes a block, the pool's blocks are %d", off, p.blockBytes)
	}
	return out, nil
}

// copyWorkerBytes is how many bytes a put copies per worker goroutine at
// least: below it one goroutine copies.
const copyWorkerBytes = 8 << 20

// copyIn copies the source block ids[i] into slots[i] for every slot
// taken (not blocks.None), on up to GOMAXPROCS goroutines for large puts.
func (p *blockPool) copyIn(slots []int32, ids []uint32, parts []part, mems [][]byte) {
	var todo []int
	for i, s := range slots {
		if s != blocks.None {
			todo = append(todo, i)
		}
	}
	one := func(i int) { copyBlock(p.mem[int64(slots[i])*p.slotBytes:], int64(ids[i]), parts, mems) }
	workers := min(runtime.GOMAXPROCS(0), 8, int(int64(len(todo))*p.blockBytes/copyWorkerBytes))
	if workers <= 1 {
		for _, i := range todo {
			one(i)
		}
		return
	}
	var wg sync.WaitGroup
	per := (len(todo) + workers - 1) / workers
	for w := range workers {
		chunk := todo[min(w*per, len(todo)):min((w+1)*per, len(todo))]
		wg.Go(func() {
			for _, i := range chunk {
				one(i)
			}
		})
	}
	wg.Wait()
}

// copyBlock copies the parts of source block id into dst, end to end.
func copyBlock(dst []byte, id int64, parts []part, mems [][]byte) {
	for _, pt := range parts {
		so := pt.base + id*pt.stride
		copy(dst[pt.off:pt.off+pt.bytes], mems[pt.region][so:so+pt.bytes])
	}
}

// pinTimeout is a lookup's pin timeout.
func pinTimeout(ms int64) time.Duration {
	if ms == 0 {
		ms = protocol.DefaultPinTimeoutMs
	}
	return time.Duration(ms) * time.Millisecond
}

// blockLookup counts the present prefix of keys, and with per_key says
// which keys are present; it pins what it found when asked (the prefix, or
// with per_key every key present).
func (cn *conn) blockLookup(r *storev1.BlockLookupRequest, bulk *os.File) (*storev1.BlockLookupResponse, error) {
	start := time.Now()
	p, keys, done, err := cn.blockKeys(r.GetPool(), r.GetCount(), r.GetKeys(), bulk, false)
	if err != nil {
		return nil, err
	}
	if p.cluster {
		defer done()
		resp, err := cn.clusterLookup(p, keys, r, bulk)
		cn.s.metrics.pools.lookupSeconds.Observe(time.Since(start).Seconds())
		return resp, err
	}
	var slots, held []int32
	var bits []byte
	if r.GetPerKey() {
		bits = make([]byte, (keys.Len()+7)/8)
		if r.GetPin() {
			slots = make([]int32, keys.Len())
		}
	}
	// hit is what the metrics count as found: the prefix, or with per_key
	// every key present.
	var n, hit int
	p.mu.Lock()
	switch {
	case slots != nil:
		hit = p.idx.Acquire(keys, slots)
	case bits != nil:
		n, hit = p.idx.Present(keys, bits)
	default:
		n = p.idx.Prefix(keys)
		hit = n
		if r.GetPin() && n > 0 {
			held = p.idx.PinPrefix(keys.Slice(0, n), make([]int32, 0, n))
		}
	}
	p.hits += uint64(hit)
	p.misses += uint64(keys.Len() - hit)
	p.mu.Unlock()
	done()
	if slots != nil {
		n = len(slots)
		held = make([]int32, 0, hit)
		for i, s := range slots {
			if s == blocks.None {
				n = min(n, i) // the first absent key ends the prefix
				continue
			}
			bits[i>>3] |= 1 << (i & 7)
			held = append(held, s)
		}
	}
	resp := &storev1.BlockLookupResponse{Found: uint32(n)}
	if bits != nil {
		resp.PresentCount = uint32(hit)
		if resp.Present, err = writeBlob("present", bits, bulk, r.GetPresentAt()); err != nil {
			if len(held) > 0 {
				p.unpin(held)
			}
			return nil, err
		}
	}
	if len(held) > 0 {
		if resp.Pin, err = cn.ss.addPin(p, held, pinTimeout(r.GetPinTimeoutMs())); err != nil {
			return nil, err
		}
	}
	m := cn.s.metrics.pools
	m.hits.WithLabelValues(p.device, "lookup").Add(float64(hit))
	m.misses.WithLabelValues(p.device, "lookup").Add(float64(keys.Len() - hit))
	m.lookupSeconds.Observe(time.Since(start).Seconds())
	return resp, nil
}

// blockGet pins the present blocks of keys and says where they are.
func (cn *conn) blockGet(r *storev1.BlockGetRequest, bulk *os.File) (*storev1.BlockGetResponse, error) {
	p, keys, done, err := cn.blockKeys(r.GetPool(), r.GetCount(), r.GetKeys(), bulk, false)
	if err != nil {
		return nil, err
	}
	slots := make([]int32, keys.Len())
	resp := &storev1.BlockGetResponse{PoolId: p.id}
	var found int
	if p.cluster {
		var unavailable int
		found, unavailable, resp.UnavailableReason = cn.acquireCluster(p, keys, slots, poolTimeout(r.GetTimeoutMs(), protocol.DefaultPoolTimeoutMs))
		resp.Unavailable = uint32(unavailable)
	} else {
		p.mu.Lock()
		found = p.idx.Acquire(keys, slots)
		p.mu.Unlock()
	}
	p.mu.Lock()
	p.hits += uint64(found)
	p.misses += uint64(keys.Len() - found)
	p.mu.Unlock()
	done()
	resp.Found = uint32(found)
	if found > 0 {
		held := make([]int32, 0, found)
		for _, s := range slots {
			if s != blocks.None {
				held = append(held, s)
			}
		}
		if resp.Pin, err = cn.ss.addPin(p, held, 0); err != nil {
			return nil, err
		}
	}
	if r.GetPin() != 0 {
		// The lookup's pin ends once the get's blocks are pinned: a block
		// both pin never becomes evictable in between. Gone already (its
		// timeout passed) is no failure of the get's.
		_ = cn.ss.unpin(r.GetPin())
	}
	out := make([]byte, 4*len(slots))
	for i, s := range slots {
		v := uint32(protocol.NoSlot)
		if s != blocks.None {
			v = uint32(s)
		}
		binary.LittleEndian.PutUint32(out[4*i:], v)
	}
	if resp.Slots, err = writeBlob("slots", out, bulk, r.GetSlotsAt()); err != nil {
		if resp.Pin != 0 {
			_ = cn.ss.unpin(resp.Pin)
		}
		return nil, err
	}
	m := cn.s.metrics.pools
	m.hits.WithLabelValues(p.device, "get").Add(float64(found))
	m.misses.WithLabelValues(p.device, "get").Add(float64(len(slots) - found))
	m.getBytes.WithLabelValues(p.device).Add(float64(int64(found) * p.blockBytes))
	return resp, nil
}

// blockDelete removes keys from a pool.
func (cn *conn) blockDelete(r *storev1.BlockDeleteRequest, bulk *os.File) (int, error) {
	p, keys, done, err := cn.blockKeys(r.GetPool(), r.GetCount(), r.GetKeys(), bulk, true)
	if err != nil {
		return 0, err
	}
	defer done()
	p.mu.Lock()
	n := p.idx.Delete(keys)
	p.mu.Unlock()
	if p.cluster {
		n += cn.clusterDelete(p, keys)
	}
	return n, nil
}

// blockEvict evicts least recently used blocks of a pool.
func (cn *conn) blockEvict(r *storev1.BlockEvictRequest) (int, error) {
	name, err := cn.qualify(r.GetPool(), false)
	if err != nil {
		return 0, err
	}
	p, err := cn.ss.poolFor(name, true)
	if err != nil {
		return 0, err
	}
	p.mu.Lock()
	n := p.idx.Evict(int(r.GetBlocks()))
	p.evictions += uint64(n)
	p.mu.Unlock()
	cn.s.metrics.pools.evictions.WithLabelValues(p.device).Add(float64(n))
	return n, nil
}
