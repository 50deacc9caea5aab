package node

import (
	"fmt"
	"sync"

	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/store"
)

// The fast path of reads across nodes (docs/kv.md, "Across nodes"). The
// first read of a space by a uid on a daemon parses the space's
// description, leases the regions the read uses (store.Replicas.
// LeaseRegistered: the store's rules decide whether that uid may read or
// write them), checks that they are the registration the description
// names, and maps them (spaceMaps). It then remembers the parsed
// description and, for that uid, each region's registration; the next
// reads find them here and only check that each registration is still
// live (store.Replicas.Live), as the client's lease fast path checks its
// slot: a registration that ended fails the check, and the read goes the
// first way, which fails as before. A read holds the mappings it uses
// until it ends, and a mapping outlives its registration only while a read
// uses it (spaceMaps.sweep), so no read touches unmapped memory; the lease
// is let go once the mappings are made.

// maxSpaceDescs bounds the descriptions a node remembers; beyond it, one
// is forgotten for each new one (a forgotten space is leased again at its
// next read).
const maxSpaceDescs = 4096

// spaceDescs are the space descriptions a node has parsed, each with the
// registrations of its regions as uids' reads found them.
type spaceDescs struct {
	mu sync.Mutex
	m  map[string]*spaceDesc // by the description's encoding
}

// spaceDesc is a parsed description and, by uid and use, its regions'
// registrations (by region number; nil: not checked yet). Their Files are
// closed: a mapping made is what the fast path uses.
type spaceDesc struct {
	d    *kv.Desc
	regs map[regsKey][]*store.Registered
}

// regsKey is a uid's use of a space: reading it (a source) or writing it
// (a destination).
type regsKey struct {
	reader uint32
	write  bool
}

// parse returns the description b encodes, parsed once.
func (sd *spaceDescs) parse(b []byte) (*kv.Desc, error) {
	sd.mu.Lock()
	e := sd.m[string(b)]
	sd.mu.Unlock()
	if e != nil {
		return e.d, nil
	}
	d := new(kv.Desc)
	if err := d.UnmarshalBinary(b); err != nil {
		return nil, err
	}
	sd.mu.Lock()
	defer sd.mu.Unlock()
	if e := sd.m[string(b)]; e != nil {
		return e.d, nil
	}
	sd.addLocked(string(b), &spaceDesc{d: d})
	return d, nil
}

func (sd *spaceDescs) addLocked(key string, e *spaceDesc) {
	if sd.m == nil {
		sd.m = map[string]*spaceDesc{}
	}
	for k := range sd.m {
		if len(sd.m) < maxSpaceDescs {
			break
		}
		delete(sd.m, k)
	}
	sd.m[key] = e
}

// known returns the registrations of regions that a read of the space b
// by k found before, or nil when one is not known.
func (sd *spaceDescs) known(b []byte, k regsKey, regions []int) []*store.Registered {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	e := sd.m[string(b)]
	if e == nil {
		return nil
	}
	all := e.regs[k]
	out := make([]*store.Registered, len(regions))
	for j, i := range regions {
		if i >= len(all) || all[i] == nil {
			return nil
		}
		out[j] = all[i]
	}
	return out
}

// remember records regs, the registrations of regions that a read of the
// space b (d, parsed) by k leased and checked.
func (sd *spaceDescs) remember(b []byte, d *kv.Desc, k regsKey, regions []int, regs []*store.Registered) {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	e := sd.m[string(b)]
	if e == nil {
		e = &spaceDesc{d: d}
		sd.addLocked(string(b), e)
	}
	if e.regs == nil {
		e.regs = map[regsKey][]*store.Registered{}
	}
	all := e.regs[k]
	if len(all) < len(d.Regions) {
		all = append(all, make([]*store.Registered, len(d.Regions)-len(all))...)
	}
	for j, i := range regions {
		r := *regs[j]
		r.Files = nil
		all[i] = &r
	}
	e.regs[k] = all
}

// forget drops what reads by k found of the space b.
func (sd *spaceDescs) forget(b []byte, k regsKey) {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	if e := sd.m[string(b)]; e != nil {
		delete(e.regs, k)
	}
}

// sweep forgets the registrations that ended (live says which have not).
func (sd *spaceDescs) sweep(live func(store.Registration) bool) {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	for _, e := range sd.m {
		for k, regs := range e.regs {
			for _, r := range regs {
				if r != nil && !live(r.Registration) {
					delete(e.regs, k)
					break
				}
			}
		}
	}
}

// spaceHold is the regions of a space one read uses, for its uid, mapped:
// Regs[j] and Maps[j] are region regions[j]'s registration and mapping.
type spaceHold struct {
	reader uint32
	D      *kv.Desc
	Regs   []*store.Registered
	Maps   []*spaceMap
	sm     *spaceMaps
}

// release lets the mappings go.
func (h *spaceHold) release() {
	for _, m := range h.Maps {
		if m != nil {
			h.sm.release(m)
		}
	}
	h.Maps = nil
}

// mapError is a failure to map a region (or register it with UCX), as
// opposed to one of the lease or the checks.
type mapError struct{ error }

func (e mapError) Unwrap() error { return e.error }

// holdRegions maps regions (ascending region numbers) of the space whose
// description is desc for uid reader, for reading, or writing (write),
// registered with UCX by register when it is set. The first read of a
// space by a uid leases the regions (failing as LeaseRegistered does) and
// vets each registration with check; the next find them (see above). A
// region that cannot be mapped fails it with a mapError.
func (n *Node) holdRegions(reader uint32, desc []byte, regions []int, write bool, register func([]byte) (*ucxtransport.Region, error),
	check func(d *kv.Desc, i int, reg *store.Registered) error) (*spaceHold, error) {
	d, err := n.descs.parse(desc)
	if err != nil {
		return nil, err
	}
	for k, i := range regions {
		if i < 0 || i >= len(d.Regions) || k > 0 && i <= regions[k-1] {
			return nil, fmt.Errorf("regions %v of a space of %d: want ascending region numbers", regions, len(d.Regions))
		}
	}
	h := &spaceHold{reader: reader, D: d, sm: &n.spaces}
	k := regsKey{reader, write}
	if regs := n.descs.known(desc, k, regions); regs != nil {
		h.Regs = regs
		for _, reg := range regs {
			m := n.spaces.mapped(reg, write, register)
			if m == nil || !n.st.Live(reg.Registration) {
				if m != nil {
					n.spaces.release(m)
				}
				h.release()
				n.descs.forget(desc, k)
				return n.leaseRegions(h, desc, regions, write, register, check)
			}
			h.Maps = append(h.Maps, m)
		}
		return h, nil
	}
	return n.leaseRegions(h, desc, regions, write, register, check)
}

// leaseRegions is holdRegions the first time: through a lease.
func (n *Node) leaseRegions(h *spaceHold, desc []byte, regions []int, write bool, register func([]byte) (*ucxtransport.Region, error),
	check func(d *kv.Desc, i int, reg *store.Registered) error) (*spaceHold, error) {
	d := h.D
	names := make([]string, len(regions))
	for k, i := range regions {
		names[k] = d.RegionName(i)
	}
	lease, err := n.st.LeaseRegistered(h.reader, names)
	if err != nil {
		return nil, err
	}
	defer lease.Release()
	h.Regs, h.Maps = lease.Regions, nil
	for k, reg := range lease.Regions {
		if err := check(d, regions[k], reg); err != nil {
			h.release()
			return nil, err
		}
		m, err := n.spaces.acquire(reg, write, register)
		if err != nil {
			h.release()
			return nil, mapError{fmt.Errorf("region %s: %w", reg.Name, err)}
		}
		h.Maps = append(h.Maps, m)
	}
	n.descs.remember(desc, d, regsKey{h.reader, write}, regions, lease.Regions)
	return h, nil
}
