-- Argo CD health check for DiphomaJob (diphoma.io/v1alpha1). Argo CD runs it with gopher-lua
-- (Lua 5.1) and `obj` set to the live object; it returns {status, message}. Install it under
-- resource.customizations.health.diphoma.io_DiphomaJob in argocd-cm (docs/integrations/README.md).
--   Healthy      phase Succeeded
--   Degraded     phase Failed, or a job the operator cannot read (condition reason InvalidSpec)
--   Suspended    spec.runPolicy.suspend, phase Suspended or condition Suspended=True
--   Progressing  every other phase (Pending, Starting, Running, Repairing, Scaling), no status
--                yet, or a status older than the spec (observedGeneration < generation)
local hs = {}
local function condition(status, ctype)
  if status.conditions == nil then return nil end
  for _, c in ipairs(status.conditions) do
    if c.type == ctype then return c end
  end
  return nil
end
local function invalid(status)
  if status.conditions == nil then return nil end
  for _, c in ipairs(status.conditions) do
    if c.reason == "InvalidSpec" then return c end
  end
  return nil
end

local st = obj.status or {}
local phase = st.phase
local suspend = obj.spec ~= nil and obj.spec.runPolicy ~= nil and obj.spec.runPolicy.suspend == true

if phase == "Succeeded" then
  local done = condition(st, "Complete")
  hs.status = "Healthy"
  hs.message = (done and done.message) or "The job succeeded"
  return hs
end
if phase == "Failed" then
  local failed = condition(st, "Failed")
  hs.status = "Degraded"
  hs.message = (failed and failed.message) or "The job failed"
  return hs
end
local bad = invalid(st)
if bad ~= nil then
  hs.status = "Degraded"
  hs.message = bad.message or "The operator cannot read this job (InvalidSpec)"
  return hs
end
local suspended = condition(st, "Suspended")
if suspend or phase == "Suspended" or (suspended ~= nil and suspended.status == "True") then
  hs.status = "Suspended"
  hs.message = (suspended ~= nil and suspended.status == "True" and suspended.message) or "The job is suspended"
  return hs
end
hs.status = "Progressing"
if phase == nil then
  hs.message = "Waiting for the operator to report a status"
elseif obj.metadata ~= nil and obj.metadata.generation ~= nil and
       (st.observedGeneration == nil or st.observedGeneration < obj.metadata.generation) then
  hs.message = "Waiting for the operator to observe the latest spec"
else
  local ready = st.ready or ((st.readyReplicas or 0) .. " ready")
  hs.message = phase .. " (" .. ready .. ")"
  if st.waiting ~= nil then hs.message = hs.message .. ": " .. st.waiting end
end
return hs
